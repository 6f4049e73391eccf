"""`minivllm bench disaggregation`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    inference_device: list[str] | None
    activation_dtype: str
    prompts: list[int] | None
    outputs: list[int] | None
    backlogs: list[int] | None
    cached_on_a: list[int] | None
    runs: int | None
    quick: bool
    burst: int
    pin_cpus: bool
    option: list[str]


def add_arguments(p) -> None:
    common.add_model(p, help="model name or path (default smollm2-135m; on a GPU, qwen2.5-coder-0.5b)")
    common.add_inference_device(p, default=None, repeatable=True,
                                help="twice: the prefill worker A, then the decode worker B "
                                     "(default: gpu then cpu where CUDA is present, else cpu:1 twice)")
    common.add_activation_dtype(p, default="auto", help="auto (f32 on CPU workers, f16 on GPU workers), f32, f16")
    p.add_argument("--prompts", type=common.int_list, default=None,
                   help="comma list of prompt lengths in tokens (default 512,1024,2048,4096,8192; clamped to the "
                        "model's context)")
    p.add_argument("--outputs", type=common.int_list, default=None,
                   help="comma list of answer lengths in tokens (default 128,512)")
    p.add_argument("--backlogs", type=common.int_list, default=None,
                   help="comma list: long requests decoding on A during each measured request (default 0,8)")
    p.add_argument("--cached-on-a", type=common.int_list, default=None,
                   help="comma list: prompt tokens already in A's prefix cache (a prefix A served before, whole "
                        "pages; default 0)")
    p.add_argument("--runs", type=int, default=None, help="runs per (case, mode) (default 3)")
    p.add_argument("--burst", type=int, default=0,
                   help="then N requests at once (the first prompt and answer lengths, A holding the largest "
                        "backlog), routed cost+split and then cost, on a fresh backlog each (default 0: none)")
    p.add_argument("--pin-cpus", action="store_true",
                   help="each CPU worker on cores of its own, physical cores first (Cluster(pin_cpus=True))")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes for tests: prompts 64,160, 8-token answers, backlogs 0,2, 1 run")
    common.add_option(p, "engine option for both workers (repeatable), e.g. page_size=16, batch_invariant=true")


def run(s: Settings) -> int:
    from minivllm.bench.disaggregation import run

    run(s.model, s.inference_device, s.activation_dtype, prompts=s.prompts, outputs=s.outputs, backlogs=s.backlogs,
        cached_on_a=s.cached_on_a, runs=s.runs, quick=s.quick, engine_options=common.engine_options(s.option),
        burst=s.burst, pin_cpus=s.pin_cpus)
    return 0


DRIVER = Driver(
    "disaggregation",
    "prefill on A, decode on B (K/V moved) vs whole on A or B, alone and under a backlog on A: when the split "
    "pays, how close the articles' break-even formula came, and what the cost+split router picked",
    add_arguments,
    Settings,
    run,
)
