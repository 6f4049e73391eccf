"""`minivllm bench routing`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    inference_device: list[str] | None
    activation_dtype: str
    runs: int | None
    max_runs: int | None
    bursts: list[int] | None
    policies: list[str] | None
    max_tokens: int | None
    prompt_tokens: int | None
    prefix_tokens: int | None
    arrival_ms: float
    max_active: int
    fresh_per_run: bool
    quick: bool
    option: list[str]
    backend: str
    ray_address: str | None


def add_arguments(p) -> None:
    common.add_model(p, help="model name or path (default smollm2-135m; the article used qwen2.5-coder-0.5b)")
    common.add_inference_device(p, default=None, repeatable=True,
                                help="repeatable: cpu, cpu:THREADS, gpu, cuda:N (default: cpu:1 twice)")
    common.add_activation_dtype(p)
    common.add_runs(p, None, "runs per (policy, burst) (default 3)",
                    max_help="per (policy, burst), more runs while the completion time's CV exceeds 5%%, up to this "
                             "(default 3 x --runs)")
    p.add_argument("--bursts", type=common.int_list, default=None, help="comma list of burst sizes (default 8,48)")
    p.add_argument("--policies", type=common.names, default=None,
                   help="comma list: forced-fastest, round-robin, least-loaded, cost, forced:<worker> "
                        "(default forced-fastest,round-robin,cost)")
    common.add_max_tokens(p, None, "output tokens per request (default 128)")
    common.add_prompt_tokens(p, None, "prompt length in tokens (default 516)")
    p.add_argument("--prefix-tokens", type=int, default=None,
                   help="shared, seeded prefix; a whole number of KV pages (default 496 = 31 pages of 16)")
    p.add_argument("--arrival-ms", type=float, default=50.0, help="time between submissions (default 50)")
    p.add_argument("--max-active", type=int, default=4, help="max_active_requests of every worker (default 4)")
    p.add_argument("--fresh-per-run", action=argparse.BooleanOptionalAction, default=True,
                   help="a fresh cluster for every run (default; independent runs) or one per (policy, burst), "
                        "re-seeded per run (quicker; runs inherit rates, cursor and caches)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes for tests: bursts 4, 1 run, 8 output tokens, 64-token prompts, 48 shared")
    common.add_option(p, "engine option for every worker (repeatable), e.g. page_size=16, enforce_eager=true")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="workers as local processes (default) or as Ray actors (Cluster(backend='ray'))")
    p.add_argument("--ray-address", default=None,
                   help="with --backend ray: the Ray cluster (auto, ray://HOST:10001; default: a private one here)")


def run(s: Settings) -> int:
    from minivllm.bench.routing import run

    run(s.model, s.inference_device, s.activation_dtype, bursts=s.bursts, policies=s.policies, runs=s.runs,
        max_runs=s.max_runs, max_tokens=s.max_tokens, prompt_tokens=s.prompt_tokens, prefix_tokens=s.prefix_tokens,
        arrival_ms=s.arrival_ms, max_active=s.max_active, fresh_per_run=s.fresh_per_run, quick=s.quick,
        engine_options=common.engine_options(s.option), backend=s.backend, ray_address=s.ray_address)
    return 0


DRIVER = Driver(
    "routing",
    "routing policies on a burst with a warm shared prefix: forced onto the fastest worker vs "
    "round-robin vs cost (completion time, throughput, TTFT, per-worker counts)",
    add_arguments,
    Settings,
    run,
)
