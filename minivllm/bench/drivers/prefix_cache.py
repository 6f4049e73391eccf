"""`minivllm bench prefix-cache`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    inference_device: str
    activation_dtype: str
    runs: int
    max_runs: int | None
    parts: list[str] | None
    groups: list[int]
    max_tokens: int | None
    max_batched_tokens: int
    max_active_requests: int
    page_size: int
    synthetic: str | None
    synthetic_tokenizer: str | None
    option: list[str]


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p)
    common.add_activation_dtype(p)
    common.add_runs(p, 3, max_help="per case, more runs (each on a fresh engine) while a watched TTFT or completion "
                                   "time's CV exceeds 5%%, up to this (default 3 x --runs)")
    p.add_argument("--parts", type=lambda v: v.split(","), default=None,
                   help="comma list: warm-prefix, cold-burst, incremental, single-flight, distinct (default all)")
    p.add_argument(
        "--groups", type=common.int_list, default=[2, 4, 8], help="request counts for incremental/single-flight"
    )
    common.add_max_tokens(p, None, "tokens per request (default 128; 32 on CPU)")
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--max-active-requests", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--synthetic", default=None, choices=["qwen2.5-7b-q4_k_m"],
                   help="a synthetic model with this layout instead of --model (random weights; GPU)")
    p.add_argument("--synthetic-tokenizer", default=None, help="GGUF to copy the synthetic model's tokenizer from")
    common.add_option(p, "engine option for every case (repeatable), e.g. dequant_cache=true")


def run(s: Settings) -> int:
    from minivllm.bench.prefix_cache import run

    run(s.model, s.inference_device, s.activation_dtype, repeats=s.runs, max_repeats=s.max_runs,
        output_tokens=s.max_tokens, parts=s.parts, groups=tuple(s.groups), page_size=s.page_size,
        max_batched_tokens=s.max_batched_tokens, max_active_requests=s.max_active_requests, synthetic=s.synthetic,
        synthetic_tokenizer=s.synthetic_tokenizer, engine_options=common.engine_options(s.option))
    return 0


DRIVER = Driver("prefix-cache", "the prefix-cache article's tables: warm-prefix TTFT, cold bursts, incremental "
                "publication, single-flight release policies, distinct-input control", add_arguments, Settings, run)
