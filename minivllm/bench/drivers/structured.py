"""`minivllm bench structured`: decode tok/s with and without JSON-schema constraints, batch
1 and 16 (minivllm/bench/structured_cost.py)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    inference_device: str
    activation_dtype: str | None
    max_tokens: int
    runs: int
    batches: str
    synthetic: str | None
    synthetic_tokenizer: str | None
    option: list[str]


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p)
    common.add_activation_dtype(p, default=None, help="f32, f16, bf16 (default f32 on CPU, f16 on GPU)")
    common.add_max_tokens(p, 64, "decode tokens per row")
    p.add_argument("--runs", type=int, default=3, help="rounds; every mode runs once in each (default 3)")
    p.add_argument("--batches", default="1,16", help="comma list of batch sizes (default 1,16)")
    common.add_synthetic(p)
    common.add_option(p, "engine option (repeatable), e.g. enforce_eager=true")


def run(s: Settings) -> int:
    from minivllm.bench.structured_cost import run

    run(
        s.model,
        s.inference_device,
        max_tokens=s.max_tokens,
        runs=s.runs,
        batches=tuple(int(b) for b in s.batches.split(",")),
        synthetic=s.synthetic,
        synthetic_tokenizer=s.synthetic_tokenizer,
        dtype=s.activation_dtype,
        engine_options=common.engine_options(s.option),
    )
    return 0


DRIVER = Driver("structured", "structured output: decode tok/s with every row, half or none under a JSON schema",
                add_arguments, Settings, run)
