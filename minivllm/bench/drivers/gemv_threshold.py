"""`minivllm bench gemv-threshold`."""

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
    concurrency: list[int]
    max_tokens: int
    batch_invariant: bool


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p)
    common.add_activation_dtype(p)
    common.add_runs(p, 3, max_help="per N, more rounds while any mode's tok/s CV exceeds 5%%, up to this "
                                   "(default 3 x --runs)")
    p.add_argument(
        "--concurrency", type=common.int_list, default=list(range(1, 9)), help="comma list of N (default 1..8)"
    )
    common.add_max_tokens(p, 32, "output tokens per request")
    p.add_argument("--batch-invariant", action="store_true", help="add a batched batch_invariant=True column")


def run(s: Settings) -> int:
    from minivllm.bench.gemv_threshold import run

    run(s.model, s.inference_device, s.activation_dtype, concurrency=s.concurrency, max_tokens=s.max_tokens,
        repeats=s.runs, max_repeats=s.max_runs, batch_invariant=s.batch_invariant)
    return 0


DRIVER = Driver("gemv-threshold", "aggregate tok/s for N requests: sequential, batched GEMM, batched row-wise GEMV",
                add_arguments, Settings, run)
