"""`minivllm bench all`'s flags and settings. Not in the registry's list, since it reads that
list; cli/bench_cmd.py adds it next to the registered drivers."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    quick: bool
    inference_device: list[str] | None
    only: list[str] | None
    skip: list[str] | None
    dry_run: bool
    timeout: float | None


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true", help="small models, few tokens, 1 run (checks every driver)")
    common.add_inference_device(p, default=None, repeatable=True,
                                help="repeatable: cpu, cuda:N (default: cuda:0 when CUDA is available, else cpu)")
    p.add_argument("--only", type=common.names, default=None, help="comma list of benchmark names to run")
    p.add_argument("--skip", type=common.names, default=None, help="comma list of benchmark names to leave out")
    p.add_argument("--dry-run", action="store_true", help="print the planned commands; run nothing")
    p.add_argument("--timeout", type=float, default=None, help="seconds per benchmark before it is killed")


def run(s: Settings) -> int:
    from minivllm.bench.suite.run import run_suite

    devices = s.inference_device
    if not devices:
        import torch

        devices = ["cuda:0"] if torch.cuda.is_available() else ["cpu"]
    try:
        return run_suite(devices, quick=s.quick, only=s.only, skip=s.skip, dry_run=s.dry_run, timeout_s=s.timeout)
    except ValueError as exc:  # an unknown --only/--skip name
        raise SystemExit(f"minivllm bench all: {exc}") from None


DRIVER = Driver("all", "run every benchmark, each as its own subprocess; write an index "
                "(benchmarks/results/bench-all-<devices>-<stamp>.json/.md); exit 1 if any failed",
                add_arguments, Settings, run)
