"""The two sides of a `compare`: what a side may be, checked before anything loads, and minivllm's side.

A side is one of

- a dict of engine options, as `LLM(...)` takes them (`{"gemv_max_rows": 0}`), optionally
  with `"device"` and `"dtype"` (`{"device": "cuda:0", "dtype": "float16"}`): minivllm's
  engine. A side on the base LLM's device and dtype forks it (`LLM.fork`: shared
  weights, its own engine); a side on another device or dtype gets its own `LLM` from
  the same GGUF file (one per device/dtype pair, shared by both sides if they agree);
- `"transformers"` (or `{"engine": "transformers", "device": ...}`): Hugging Face
  transformers in float32 loading the same GGUF file, the repository's independent
  reference (reference_sides.TransformersSide);
- `"llama.cpp"`: llama-cpp-python on the CPU, logits only (reference_sides.LlamaCppSide).

`side_from_text` reads the form users type (the CLI's `--a`, the widget):
"transformers", "llama.cpp", or "device=cuda:0, dtype=f16, gemv_max_rows=0".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.debug.hidden_state_diff import engine_replay
from minivllm.devices import describe_device, dtype_name, resolve_device, resolve_dtype
from minivllm.engine.options import check_engine_options, parse_overrides
from minivllm.errors import ConfigError, DeviceError, EngineNotInstalledError, MinivllmError
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.structured import StructuredOutput

ENGINES = ("minivllm", "transformers", "llama.cpp")
ENGINE_ALIASES = {"minivllm": "minivllm", "transformers": "transformers", "hf": "transformers",
                  "llama.cpp": "llama.cpp", "llama_cpp": "llama.cpp", "llamacpp": "llama.cpp"}
SIDE_KEYS = ("engine", "device", "dtype", "structured")  # what a side may say besides engine options


@dataclass(frozen=True)
class SideSpec:
    side: str  # "a" or "b"
    engine: str  # one of ENGINES
    options: dict  # engine options (minivllm only)
    device: torch.device | None  # None: the base LLM's
    dtype: torch.dtype | None  # None: the base LLM's (minivllm); transformers is always float32
    given: dict  # the side as the caller gave it (the report's a_options / b_options)
    # minivllm only: generate under this constraint (sampling/structured.py), so the token
    # view shows what the mask removed from the top-k next to an unconstrained side.
    structured: StructuredOutput | None = None


def parse_side(spec, side: str) -> SideSpec:
    """Check one side's spec; raise a ConfigError naming the side and the fix."""
    if spec is None:
        spec = {}
    if isinstance(spec, str):
        engine = ENGINE_ALIASES.get(spec.strip().lower())
        if engine is None:
            raise ConfigError(side, spec, f"a side is a dict of engine options or one of {', '.join(ENGINES[1:])}")
        spec = {"engine": engine}
    if not isinstance(spec, dict):
        raise ConfigError(side, spec, "expected a dict of engine options (e.g. {'gemv_max_rows': 0}, "
                                      "{'device': 'cuda:0', 'dtype': 'f16'}) or 'transformers' / 'llama.cpp'")
    given = dict(spec)
    options = dict(spec)
    engine_name = options.pop("engine", "minivllm")
    engine = ENGINE_ALIASES.get(str(engine_name).lower())
    if engine is None:
        raise ConfigError(f"{side}.engine", engine_name, f"expected one of {', '.join(ENGINES)}")
    device = _device(options.pop("device"), side) if "device" in options else None
    dtype = _dtype(options.pop("dtype"), side) if "dtype" in options else None
    structured = options.pop("structured", None)
    if structured is not None and engine != "minivllm":
        raise ConfigError(f"{side}.structured", structured, "only a minivllm side decodes under a constraint")
    if isinstance(structured, str):  # from a text field: a JSON object such as {"regex": "..."}
        import json

        try:
            structured = json.loads(structured)
        except ValueError as exc:
            raise ConfigError(f"{side}.structured", structured, f"not a JSON object: {exc}") from None
    structured = StructuredOutput.coerce(structured)
    if engine == "minivllm":
        options = check_engine_options(options, side)
    elif options:
        raise ConfigError(f"{side}.{next(iter(options))}", options[next(iter(options))],
                          f"the {engine} side takes no engine options (only {', '.join(SIDE_KEYS)}); "
                          f"give them to a minivllm side")
    if engine == "transformers":
        if dtype not in (None, torch.float32):
            raise ConfigError(f"{side}.dtype", given["dtype"], "the transformers side is the float32 reference; "
                                                               "leave dtype out")
        _require("transformers", side, "pip install transformers")
    if engine == "llama.cpp":
        if dtype is not None or (device is not None and device.type != "cpu"):
            raise ConfigError(side, given, "the llama.cpp side runs on the CPU with ggml's own activation types; "
                                           "leave device and dtype out")
        from minivllm.bench.decode import load_llama_cpp

        module, why = load_llama_cpp()
        if module is None:
            raise EngineNotInstalledError(side, "llama.cpp", f"llama-cpp-python is {why}")
    return SideSpec(side, engine, options, device, dtype, given, structured)


def side_from_text(text: str | list[str], side: str):
    """"transformers" / "llama.cpp" / "KEY=VALUE, ..." (engine options plus device, dtype,
    engine) → what `compare` takes for that side."""
    items = [text] if isinstance(text, str) else list(text)
    if len(items) == 1 and items[0].strip().lower() in ENGINE_ALIASES:
        engine = ENGINE_ALIASES[items[0].strip().lower()]
        return {} if engine == "minivllm" else engine
    if isinstance(text, str) and text.strip().startswith("{"):
        import json

        try:
            return json.loads(text)
        except ValueError as e:
            raise ConfigError(side, text, f"not a JSON object: {e}") from None
    parts = [p for item in items for p in item.split(",") if p.strip()]
    extra = {}
    rest = []
    for part in parts:
        key, sep, value = part.partition("=")
        if sep and key.strip().replace("-", "_") in SIDE_KEYS:
            extra[key.strip().replace("-", "_")] = value.strip()
        else:
            rest.append(part)
    return {**extra, **parse_overrides(rest, side)}


def _device(value, side: str) -> torch.device:
    try:
        return resolve_device(value)
    except DeviceError as exc:
        why = (f"torch sees no NVIDIA GPU here (torch {torch.__version__}, CUDA build: {torch.version.cuda})"
               if not torch.cuda.is_available() else str(exc))
        raise ConfigError(f"{side}.device", value, f"{why}; give side {side} device 'cpu' (or an existing cuda:N)") \
            from None
    except ConfigError:
        raise ConfigError(f"{side}.device", value, f"side {side}: expected cpu, gpu, cuda or cuda:N") from None


def _dtype(value, side: str) -> torch.dtype:
    try:
        return resolve_dtype(value)
    except ConfigError as exc:
        raise ConfigError(f"{side}.dtype", value, f"side {side}: {str(exc).split(': ', 1)[-1]}") from None


def _require(module: str, side: str, fix: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise EngineNotInstalledError(side, module, f"the {module} package is not installed here ({fix})")


def side_machine(side) -> dict:
    """What the report's machine["sides"] says about one side."""
    settings = side.settings()
    return {"engine": settings["engine"], "device": settings["device"], "dtype": settings["dtype"]}


class EngineSide:
    """minivllm's engine as a side: an `LLM` (a fork of the base or of a side's own load)."""

    engine = "minivllm"

    def __init__(self, side: str, llm, weights: str, structured: StructuredOutput | None = None):
        self.side, self.llm, self.weights, self.structured = side, llm, weights, structured
        self.device = llm.device
        self.n_layers = llm.config.n_layers

    def settings(self) -> dict:
        """The settings a side actually ran with: device, dtype, its kernel options with device
        defaults filled in, chunk size and KV mode."""
        engine = self.llm.engine
        return {"engine": "minivllm", "device": describe_device(self.llm.device), "dtype": dtype_name(self.llm.dtype),
                "weights": self.weights, **engine.kernel_options.describe(),
                "max_batched_tokens": engine.config.max_batched_tokens, "kv_mode": engine.config.kv_mode,
                "structured": self.structured.describe() if self.structured is not None else None}

    def replay(self, token_ids: list[int], n_prompt: int):
        return engine_replay(self.llm, token_ids, n_prompt)

    def not_comparable(self) -> dict[int, str]:
        return {}

    def greedy(self, prompt_ids: list[int], max_tokens: int, k: int,
               ) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        """Generate greedily through the engine; return the tokens and, per token, the top-k
        (ids, float32 logits) of the row it was sampled from."""
        engine = self.llm.engine
        rid = f"diverge-{self.side}"
        tops: list[tuple[list[int], list[float]]] = []

        def record(request_id: str, logits: torch.Tensor) -> None:
            if request_id == rid:
                values, ids = torch.topk(logits.float(), k)
                tops.append((ids.tolist(), values.tolist()))

        previous = getattr(engine, "logits_hook", None)
        engine.logits_hook = record
        try:
            engine.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          structured=self.structured), request_id=rid)
            for _ in engine.run(until=lambda: engine.request_state(rid).finished):
                pass
        finally:
            engine.logits_hook = previous
            engine.abort(rid)  # a no-op when it finished; frees the pages when interrupted
        error = engine.request_state(rid).error
        out = engine.pop_output(rid)
        if out.finish_reason == "error":
            raise MinivllmError(f"side {self.side} failed while generating: {error}")
        if len(tops) != len(out.token_ids):
            raise MinivllmError(f"side {self.side}: the engine reported logits for {len(tops)} of {len(out.token_ids)} "
                                f"generated tokens; its logits_hook is not called once per sampled row")
        return list(out.token_ids), tops
