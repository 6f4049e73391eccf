"""`minivllm bench scheduling`."""

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
    policies: list[str] | None
    long_prompts: int
    long_tokens: int
    short_tokens: int
    fair_prompts: int
    fair_tokens: int
    max_batched_tokens: int
    max_tokens: int
    page_size: int


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p)
    common.add_activation_dtype(p)
    common.add_runs(p, 3, max_help="per workload, more rounds while a watched TTFT's CV exceeds 5%%, up to this "
                                   "(default 3 x --runs)")
    p.add_argument("--policies", type=lambda v: v.split(","), default=None,
                   help="comma list (default fcfs,shortest-prefill-first,round-robin)")
    p.add_argument("--long-prompts", type=int, default=3, help="head of line: long prompts before the short one")
    p.add_argument("--long-tokens", type=int, default=400)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--fair-prompts", type=int, default=4, help="fairness: long prompts submitted together")
    p.add_argument("--fair-tokens", type=int, default=400)
    p.add_argument("--max-batched-tokens", type=int, default=64, help="small, so prefills are chunked")
    common.add_max_tokens(p, 16, "output tokens per request")
    p.add_argument("--page-size", type=int, default=16)


def run(s: Settings) -> int:
    from minivllm.bench.scheduling import run

    run(s.model, s.inference_device, s.activation_dtype, policies=s.policies, repeats=s.runs, max_repeats=s.max_runs,
        long_prompts=s.long_prompts, long_tokens=s.long_tokens, short_tokens=s.short_tokens,
        fair_prompts=s.fair_prompts, fair_tokens=s.fair_tokens, max_batched_tokens=s.max_batched_tokens,
        max_tokens=s.max_tokens, page_size=s.page_size)
    return 0


DRIVER = Driver("scheduling", "scheduling policies: head-of-line TTFT and fairness between long prefills",
                add_arguments, Settings, run)
