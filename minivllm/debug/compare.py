"""`compare`: run one prompt greedily on two sides and explain where they part.

    from minivllm.debug import compare
    report = compare("smollm2-135m", "Once upon a time", a={"gemv_max_rows": 0}, b={"gemv_max_rows": 4096},
                     max_tokens=200)
    report.first_divergence        # where the greedy tokens first differ (None: they never do)
    report.records[i].a.margin     # how close each choice was
    print(report.summary())        # shared prefix, both continuations, top-k, per-layer table

    compare("smollm2-135m", prompt, a={}, b="transformers")                  # the engine vs the f32 reference
    compare("smollm2-135m", prompt, a={"dtype": "f32"}, b={"dtype": "bf16"})  # two dtypes
    compare(llm, prompt, a={"device": "cpu"}, b={"device": "cuda:0", "dtype": "f16"})

A side is engine options (optionally with a device and dtype), "transformers" or
"llama.cpp" (sides.py says exactly what each may be). Sides on the base LLM's device and
dtype share its weights (`LLM.fork`), so only the engine options differ; a side on
another device or dtype gets its own load of the same file. Each minivllm side generates
through its own engine, exactly as `LLM.generate` would, with a logits hook recording the
top-k of every row it samples from; an outside engine generates token by token through
its own KV cache (reference_sides.py). At the first split, the common prefix is replayed
on each side to show, layer by layer, how far apart the residual streams already were
(see hidden_state_diff.py). When the sides are different computations (another engine,
device or dtype) the table is made even without a split, over everything generated:
exact equality is not expected there, and `first_layer_difference` says where b first
leaves a at all.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from minivllm.debug.divergence_report import (
    DivergenceReport,
    FirstDivergence,
    LayerDiff,
    PositionRecord,
    ReplayCheck,
    SideToken,
    TopToken,
)
from minivllm.debug.hidden_state_diff import diff_replays
from minivllm.debug.reference_sides import LlamaCppSide, TransformersSide
from minivllm.debug.sides import EngineSide, SideSpec, parse_side, side_machine
from minivllm.devices import check_dtype_supported, describe_device, dtype_name, resolve_device, resolve_dtype
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError, DeviceError


def compare(model, prompt: str | list[int], a: dict | str | None = None, b: dict | str | None = None, *,
            max_tokens: int = 64, top_k: int = 5, chat: bool = False, device: str | None = None,
            dtype: str | None = None, progress: bool = False, hidden_states: bool = True,
            on_phase=None) -> DivergenceReport:
    """Greedy generations of `prompt` on sides `a` and `b`, and where they split.

    `model` is a registered name or .gguf path (the base: `device` with activation
    `dtype`, defaults cpu / float32; loaded only if a side runs there), or an `LLM` whose
    loaded weights are reused. `a` and `b` are engine options as `LLM(...)` takes them
    (gemv_max_rows, max_batched_tokens, batch_invariant, kv_mode, ...), plus optionally
    "device" and "dtype"; or "transformers" / "llama.cpp". Options a side leaves out keep
    the given LLM's values (the defaults for a name), and the report's `a_settings` /
    `b_settings` say what each side actually ran with, device and dtype included. `chat`
    wraps the prompt in the model's chat template as a user message. `hidden_states=False`
    skips the per-layer replay (it costs about as much as generating the prefix again).
    `on_phase(words, fraction)`, if given, is called as each phase starts ("loading side b",
    "generating a", "per-layer capture", ...) with the fraction of the phases done.
    """
    phases = ["loading side a", "loading side b", "generating a", "generating b", "per-layer capture"]

    def phase(name: str) -> None:
        if on_phase is not None:
            on_phase(name, phases.index(name) / len(phases))

    spec_a, spec_b = parse_side(a, "a"), parse_side(b, "b")
    if not (isinstance(top_k, int) and top_k >= 1):
        raise ConfigError("top_k", top_k, "must be an integer >= 1 (how many logits to record per position)")
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ConfigError("max_tokens", max_tokens, "must be an integer >= 1")
    models = _Models(model, device, dtype, progress)
    engine_sides = {}
    for s in (spec_a, spec_b):
        if s.engine == "minivllm":
            phase(f"loading side {s.side}")
            engine_sides[s.side] = _engine_side(s, models)
    tok = models.tokenizer()
    prompt_ids = _prompt_ids(tok, prompt, chat)
    sides = {}
    for s in (spec_a, spec_b):
        if s.side not in engine_sides:
            phase(f"loading side {s.side}")
        sides[s.side] = engine_sides.get(s.side) or _reference_side(s, models, len(prompt_ids) + max_tokens, tok)
    side_a, side_b = sides["a"], sides["b"]

    k = max(top_k, 2)  # the margin needs the runner-up even when the user asks for top-1
    phase("generating a")
    ids_a, top_a = side_a.greedy(prompt_ids, max_tokens, k)
    phase("generating b")
    ids_b, top_b = side_b.greedy(prompt_ids, max_tokens, k)

    def side_token(ids, tops, i) -> SideToken | None:
        if i >= len(ids):
            return None
        top_ids, top_vals = tops[i]
        top = [TopToken(t, tok.decode([t]), v) for t, v in zip(top_ids, top_vals)]
        return SideToken(ids[i], tok.decode([ids[i]]), top[:top_k], top_vals[0] - top_vals[1])

    records = [PositionRecord(i, side_token(ids_a, top_a, i), side_token(ids_b, top_b, i))
               for i in range(max(len(ids_a), len(ids_b)))]
    split = next((r.position for r in records if not r.same), None)

    first = None
    if split is not None:
        rec = records[split]
        shared = ids_a[:split]
        shared_text = tok.decode(shared)
        first = FirstDivergence(
            position=split, sequence_position=len(prompt_ids) + split, identical_tokens=split,
            identical_chars=len(shared_text), shared_text=shared_text,
            a_token=TopToken(rec.a.token_id, rec.a.text, rec.a.top[0].logit) if rec.a else None,
            b_token=TopToken(rec.b.token_id, rec.b.text, rec.b.top[0].logit) if rec.b else None,
            a_margin=rec.a.margin if rec.a else None, b_margin=rec.b.margin if rec.b else None,
            a_continuation=tok.decode(ids_a[split:]), b_continuation=tok.decode(ids_b[split:]),
        )
    # Two option sets on one model are compared layer by layer only where they split; two
    # different computations (engine, device, dtype) always, since equality is not expected.
    different = (spec_a.engine, side_a.device, _side_dtype(side_a)) != (
        spec_b.engine,
        side_b.device,
        _side_dtype(side_b),
    )
    layers = _LayerReport()
    if hidden_states and (split is not None or different):
        phase("per-layer capture")
        layers = _layer_report(side_a, side_b, prompt_ids, ids_a, split, (top_a, top_b))

    return DivergenceReport(
        model=_model_name(models.sha256(), models.given_name, models.path), model_path=str(models.path),
        model_sha256=models.sha256(), device=describe_device(models.device), activation_dtype=dtype_name(models.dtype),
        prompt=prompt if isinstance(prompt, str) else None, chat=chat, prompt_token_ids=prompt_ids,
        a_options=spec_a.given, b_options=spec_b.given, a_settings=side_a.settings(), b_settings=side_b.settings(),
        max_tokens=max_tokens, top_k=top_k,
        a_token_ids=ids_a, b_token_ids=ids_b, a_text=tok.decode(ids_a), b_text=tok.decode(ids_b),
        records=records, first_divergence=first, layer_diffs=layers.diffs, replay=layers.replay,
        machine=_machine(sides), layer_note=layers.note, first_layer_difference=layers.first,
    )


class _Models:
    """The base (device, dtype, engine options, file) and every minivllm LLM loaded for the sides."""

    def __init__(self, model, device, dtype, progress: bool):
        self.progress = progress
        if isinstance(model, LLM):
            if device is not None or dtype is not None:
                raise ConfigError("device/dtype", (device, dtype),
                                  f"compare() reuses the given LLM's loaded weights ({describe_device(model.device)}, "
                                  f"{dtype_name(model.dtype)}); leave device and dtype out (a side may set its own: "
                                  f"b={{'device': 'cuda:0', 'dtype': 'f16'}}), or pass a model name")
            self.path, self.given_name = Path(model.model_path), None
            self.device, self.dtype, self.options = model.device, model.dtype, model.engine_options()
            self.loaded = {(model.device, model.dtype): model}
            return
        if not isinstance(model, (str, Path)):
            raise ConfigError("model", model, "expected a registered model name, a .gguf path or a minivllm.LLM")
        from minivllm.models import resolve_model

        self.device, self.dtype = resolve_device(device or "cpu"), resolve_dtype(dtype or "float32")
        check_dtype_supported(self.device, self.dtype)
        self.path, self.given_name = Path(resolve_model(str(model), progress=progress)), str(model)
        self.options, self.loaded = {}, {}
        self._sha256 = None

    def llm(self, spec: SideSpec) -> tuple[LLM, str]:
        """The LLM a minivllm side forks, and what the report says about its weights."""
        key = (spec.device or self.device, spec.dtype or self.dtype)
        if key not in self.loaded:
            try:
                check_dtype_supported(*key)
            except DeviceError as exc:
                raise ConfigError(f"{spec.side}.dtype", spec.given.get("dtype"), f"{exc} (side {spec.side})") from None
            llm = LLM(str(self.path), device=str(key[0]), dtype=dtype_name(key[1]), progress=self.progress,
                      **self.options)
            # It only lends its weights to the forks; its own engine's KV pool would hold
            # memory (a third of it on a GPU) that no side uses.
            llm.engine = None
            self.loaded[key] = llm
        if key == (self.device, self.dtype):
            return self.loaded[key], "shared with the base LLM (fork)"
        return self.loaded[key], f"own load on {describe_device(key[0])}, {dtype_name(key[1])}"

    def tokenizer(self):
        if self.loaded:
            return next(iter(self.loaded.values())).tokenizer
        from minivllm.gguf.reader import GGUFFile
        from minivllm.gguf.tokenizer import Tokenizer

        return Tokenizer.from_gguf(GGUFFile(self.path))

    def sha256(self) -> str:
        if getattr(self, "_sha256", None) is None:
            self._sha256 = _model_sha256(self.path)
        return self._sha256


def _engine_side(spec: SideSpec, models: _Models) -> EngineSide:
    llm, weights = models.llm(spec)
    return EngineSide(spec.side, llm.fork(**spec.options), weights, spec.structured)


def _reference_side(spec: SideSpec, models: _Models, n_ctx: int, tok):
    if spec.engine == "transformers":
        return TransformersSide(spec.side, models.path, spec.device or models.device, tok.eos_ids)
    return LlamaCppSide(spec.side, models.path, tok.eos_ids, n_ctx + 8)


def _side_dtype(side) -> str:
    return side.settings()["dtype"]


def _prompt_ids(tok, prompt, chat: bool) -> list[int]:
    if chat:
        if not isinstance(prompt, str):
            raise ConfigError("prompt", prompt, "with chat=True the prompt must be the user message as a string")
        return tok.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)[1]
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ConfigError("prompt", prompt, "expected a non-empty string or a list of token ids")


class _LayerReport:
    def __init__(self, diffs=None, replay=None, note=None, first=None):
        self.diffs, self.replay, self.note, self.first = diffs or [], replay, note, first


def _layer_report(side_a, side_b, prompt_ids, ids_a, split, tops) -> _LayerReport:
    """Replay the common tokens on both sides and diff their residual streams."""
    if split is not None:
        # Both sides reached the split from the same tokens, so the replay input is common;
        # its last row is the one whose logits chose the differing token.
        at, note = split, None
    else:
        at = len(ids_a) - 1
        note = (f"no split within {len(ids_a)} generated tokens: the table covers the prompt and the first {at} "
                f"generated tokens, and its 'split' columns are the row that chose the last generated token")
    sequence = prompt_ids + ids_a[:at]
    replays = [side.replay(sequence, len(prompt_ids)) for side in (side_a, side_b)]  # lazy: nothing runs yet
    for side, replay in zip((side_a, side_b), replays):
        if replay is None:
            return _LayerReport(note=f"side {side.side} ({side.engine}) exposes no hidden states (logits only): "
                                     f"there is no per-layer table")
    diffs, logits_a, logits_b = diff_replays(*replays, len(sequence))
    for index, why in {**side_a.not_comparable(), **side_b.not_comparable()}.items():
        nan = float("nan")
        diffs[index] = replace(diffs[index], at_split_max_abs=nan, at_split_rel_l2=nan, prefix_max_abs=nan,
                               prefix_rel_l2=nan, first_differing_position=None, comparable=False)
        note = why if note is None else f"{note}; {why}"
    top_a, top_b = tops
    replay = ReplayCheck(
        a_token=int(torch.argmax(logits_a)), b_token=int(torch.argmax(logits_b)),
        a_top_logits_max_abs_diff=_top_logit_gap(logits_a, top_a[at]) if at < len(top_a) else None,
        b_top_logits_max_abs_diff=_top_logit_gap(logits_b, top_b[at]) if at < len(top_b) else None,
    )
    return _LayerReport(diffs, replay, note, first_layer_difference(diffs, len(prompt_ids)))


def first_layer_difference(diffs: list[LayerDiff], n_prompt: int) -> dict | None:
    """The earliest sequence position where any comparable layer differs, and the first layer
    that differs there: where b first leaves a. None: identical everywhere compared."""
    hits = [(d.first_differing_position, i) for i, d in enumerate(diffs)
            if d.comparable and d.first_differing_position is not None]
    if not hits:
        return None
    position, index = min(hits)
    d = diffs[index]
    return {"layer": d.layer, "layer_index": index, "position": position, "in_prompt": position < n_prompt,
            "prefix_rel_l2": d.prefix_rel_l2 if not math.isnan(d.prefix_rel_l2) else None}


def _machine(sides: dict) -> dict:
    from minivllm.kernels import cpu_gemv
    from minivllm.obs.machine import cpu_fingerprint

    machine = cpu_fingerprint()
    # minivllm's own compiled f32 GEMV picks its ISA from the CPU flags, like MKL does (named
    # apart from the engine option cpu_gemv, which says what a GEMV runs).
    machine["cpu_gemv_isa"] = cpu_gemv.isa() or f"torch ({cpu_gemv.unavailable_reason()})"
    gpus = sorted({describe_device(s.device) for s in sides.values() if s.device.type == "cuda"})
    if gpus:
        machine["gpu"] = ", ".join(gpus)
        machine["cuda"] = torch.version.cuda
    machine["sides"] = {name: side_machine(side) for name, side in sides.items()}
    return machine


def _top_logit_gap(replay_logits: torch.Tensor, engine_top: tuple[list[int], list[float]]) -> float:
    ids, values = engine_top
    replayed = replay_logits.float()[torch.tensor(ids, device=replay_logits.device)].cpu()
    return float((replayed - torch.tensor(values)).abs().max())


def _model_name(sha256: str, given: str | None, path: Path) -> str:
    """The registered name when the file's hash is a registered model's, else what the user gave."""
    from minivllm.models.registry import REGISTRY

    for name, entry in REGISTRY.items():
        if getattr(entry.source, "sha256", None) == sha256:
            return name
    return given or path.name


def _model_sha256(path: Path) -> str:
    # A verified assembly leaves a stamp with the hash; reading it spares hashing gigabytes.
    from minivllm.models.cache import sha256_file, stamp_path

    stamp = stamp_path(path)
    if stamp.exists() and stamp.stat().st_mtime >= path.stat().st_mtime:
        return stamp.read_text().strip()
    return sha256_file(path)
