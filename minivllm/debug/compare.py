"""`compare`: run one prompt greedily under two sets of engine options and explain the split.

    from minivllm.debug import compare
    report = compare("smollm2-135m", "Once upon a time", a={"gemv_max_rows": 0}, b={"gemv_max_rows": 4096},
                     max_tokens=200)
    report.first_divergence        # where the greedy tokens first differ (None: they never do)
    report.records[i].a.margin     # how close each choice was
    print(report.summary())        # shared prefix, both continuations, top-k, per-layer table

Both sides share one loaded model (`LLM.fork`), so only the engine options differ.
Each side generates through its own engine, exactly as `LLM.generate` would, with a
logits hook recording the top-k of every row it samples from. At the first split,
the common prefix is replayed under each side's options to show, layer by layer,
how far apart the residual streams already were (see hidden_state_diff.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minivllm.debug.divergence_report import (
    DivergenceReport, FirstDivergence, PositionRecord, ReplayCheck, SideToken, TopToken,
)
from minivllm.engine.options import check_engine_options
from minivllm.debug.hidden_state_diff import diff_hidden_states
from minivllm.devices import describe_device, dtype_name
from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.errors import ConfigError, MinivllmError


def compare(model, prompt: str | list[int], a: dict | None = None, b: dict | None = None, *,
            max_tokens: int = 64, top_k: int = 5, chat: bool = False, device: str | None = None,
            dtype: str | None = None, progress: bool = False, hidden_states: bool = True) -> DivergenceReport:
    """Greedy generations of `prompt` under engine options `a` and `b`, and where they split.

    `model` is a registered name or .gguf path (loaded once, on `device` with activation
    `dtype`; defaults cpu / float32), or an `LLM` whose loaded weights are reused.
    `a` and `b` are engine options as `LLM(...)` takes them (gemv_max_rows,
    max_batched_tokens, batch_invariant, kv_mode, ...); options a side leaves out keep
    the given LLM's values (the defaults for a name), and the report's `a_settings` /
    `b_settings` say what each side actually ran with. `chat` wraps the prompt in the
    model's chat template as a user message. `hidden_states=False` skips the per-layer
    replay (it costs about as much as generating the prefix again).
    """
    a = check_engine_options(a or {}, "a")
    b = check_engine_options(b or {}, "b")
    if not (isinstance(top_k, int) and top_k >= 1):
        raise ConfigError("top_k", top_k, "must be an integer >= 1 (how many logits to record per position)")
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ConfigError("max_tokens", max_tokens, "must be an integer >= 1")
    llm, given_name = _base_llm(model, device, dtype, progress)
    model_path = Path(llm.model_path)
    sha256 = _model_sha256(model_path)
    side_a, side_b = llm.fork(**a), llm.fork(**b)
    if not isinstance(model, LLM):
        # The LLM built here only lends its weights to the forks; its own engine's KV pool
        # would hold memory (a third of it on a GPU) that neither side uses.
        llm.engine = None
    tok = llm.tokenizer

    if chat:
        if not isinstance(prompt, str):
            raise ConfigError("prompt", prompt, "with chat=True the prompt must be the user message as a string")
        prompt_ids = llm.chat_prompt_ids([{"role": "user", "content": prompt}])[1]
    elif isinstance(prompt, str):
        prompt_ids = tok.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) for t in prompt):
        prompt_ids = list(prompt)
    else:
        raise ConfigError("prompt", prompt, "expected a non-empty string or a list of token ids")

    k = max(top_k, 2)  # the margin needs the runner-up even when the user asks for top-1
    ids_a, top_a = _greedy_run(side_a, prompt_ids, max_tokens, k, "a")
    ids_b, top_b = _greedy_run(side_b, prompt_ids, max_tokens, k, "b")

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
    layer_diffs = []
    replay = None
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
    if split is not None and hidden_states:
        # Both sides reached the split from the same tokens, so the replay input is common;
        # its last row is the one whose logits chose the differing token.
        layer_diffs, logits_a, logits_b = diff_hidden_states(side_a, side_b, prompt_ids + shared, len(prompt_ids))
        replay = ReplayCheck(
            a_token=int(torch.argmax(logits_a)), b_token=int(torch.argmax(logits_b)),
            a_top_logits_max_abs_diff=_top_logit_gap(logits_a, top_a[split]) if split < len(top_a) else None,
            b_top_logits_max_abs_diff=_top_logit_gap(logits_b, top_b[split]) if split < len(top_b) else None,
        )

    return DivergenceReport(
        model=_model_name(sha256, given_name, model_path), model_path=str(model_path), model_sha256=sha256,
        device=describe_device(llm.device), activation_dtype=dtype_name(llm.dtype),
        prompt=prompt if isinstance(prompt, str) else None, chat=chat, prompt_token_ids=prompt_ids,
        a_options=a, b_options=b, a_settings=_side_settings(side_a), b_settings=_side_settings(side_b),
        max_tokens=max_tokens, top_k=top_k,
        a_token_ids=ids_a, b_token_ids=ids_b, a_text=tok.decode(ids_a), b_text=tok.decode(ids_b),
        records=records, first_divergence=first, layer_diffs=layer_diffs, replay=replay,
        machine=_machine(llm.device),
    )


def _base_llm(model, device, dtype, progress):
    if isinstance(model, LLM):
        if device is not None or dtype is not None:
            raise ConfigError("device/dtype", (device, dtype),
                              f"compare() reuses the given LLM's loaded weights ({describe_device(model.device)}, "
                              f"{dtype_name(model.dtype)}); leave device and dtype out, or pass a model name")
        return model, None
    if not isinstance(model, (str, Path)):
        raise ConfigError("model", model, "expected a registered model name, a .gguf path or a minivllm.LLM")
    llm = LLM(str(model), device=device or "cpu", dtype=dtype or "float32", progress=progress)
    return llm, str(model)


def _machine(device: torch.device) -> dict:
    from minivllm.obs.machine import cpu_fingerprint

    from minivllm.kernels import cpu_gemv

    machine = cpu_fingerprint()
    # minivllm's own compiled f32 GEMV picks its ISA from the CPU flags, like MKL does.
    machine["cpu_gemv"] = cpu_gemv.isa() or f"torch ({cpu_gemv.unavailable_reason()})"
    if device.type == "cuda":
        machine["gpu"] = describe_device(device)
        machine["cuda"] = torch.version.cuda
    return machine


def _side_settings(llm) -> dict:
    """The settings a side actually ran with: its kernel options with device defaults filled in."""
    return {**llm.engine.kernel_options.describe(), "max_batched_tokens": llm.engine.config.max_batched_tokens,
            "kv_mode": llm.engine.config.kv_mode}


def _greedy_run(llm, prompt_ids: list[int], max_tokens: int, k: int, side: str,
                ) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
    """Generate greedily through `llm`'s engine; return the tokens and, per token, the top-k
    (ids, float32 logits) of the row it was sampled from."""
    engine = llm.engine
    rid = f"diverge-{side}"
    tops: list[tuple[list[int], list[float]]] = []

    def record(request_id: str, logits: torch.Tensor) -> None:
        if request_id == rid:
            values, ids = torch.topk(logits.float(), k)
            tops.append((ids.tolist(), values.tolist()))

    previous = getattr(engine, "logits_hook", None)
    engine.logits_hook = record
    try:
        engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), request_id=rid)
        for _ in engine.run(until=lambda: engine.request_state(rid).finished):
            pass
    finally:
        engine.logits_hook = previous
        engine.abort(rid)  # a no-op when it finished; frees the pages when interrupted
    error = engine.request_state(rid).error
    out = engine.pop_output(rid)
    if out.finish_reason == "error":
        raise MinivllmError(f"side {side} failed while generating: {error}")
    if len(tops) != len(out.token_ids):
        raise MinivllmError(f"side {side}: the engine reported logits for {len(tops)} of {len(out.token_ids)} "
                            f"generated tokens; its logits_hook is not called once per sampled row")
    return list(out.token_ids), tops


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
