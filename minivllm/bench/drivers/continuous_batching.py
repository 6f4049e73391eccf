"""`minivllm bench continuous-batching`."""

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
    decode_lengths: list[int] | None
    quick: bool
    max_batched_tokens: int
    page_size: int
    parts: list[str] | None


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p)
    common.add_activation_dtype(p)
    common.add_runs(p, 3, max_help="per row, more rounds while either mode's tok/s CV exceeds 5%%, up to this "
                                   "(default 3 x --runs)")
    p.add_argument("--concurrency", type=common.int_list, default=[1, 2, 3, 4, 5, 8],
                   help="comma list of N (default 1,2,3,4,5,8)")
    common.add_max_tokens(p, 64, "output tokens per request in the batching runs")
    p.add_argument("--decode-lengths", type=common.int_list, default=None,
                   help="comma list of output lengths for paged vs contiguous (default 512,2048; 128,512 on CPU)")
    p.add_argument("--quick", action="store_true", help="decode lengths 128,512 (the CPU default)")
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--parts", type=lambda v: v.split(","), default=None,
                   help="comma list of experiments to run: batching, kv (default both)")


def run(s: Settings) -> int:
    from minivllm.bench.continuous_batching import run

    run(s.model, s.inference_device, s.activation_dtype, concurrency=s.concurrency, max_tokens=s.max_tokens,
        decode_lengths=s.decode_lengths, quick=s.quick, repeats=s.runs, max_repeats=s.max_runs,
        max_batched_tokens=s.max_batched_tokens, page_size=s.page_size, parts=s.parts)
    return 0


DRIVER = Driver(
    "continuous-batching",
    "aggregate tok/s batched vs sequential for N requests; paged vs contiguous decode",
    add_arguments,
    Settings,
    run,
)
