"""`minivllm bench activation-dtype`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    inference_device: str
    activation_dtype: list[str] | None
    prompt_tokens: int
    max_tokens: int
    runs: int
    max_runs: int | None
    threads: int | None


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p)
    common.add_activation_dtype(p, default=None, repeatable=True,
                                help="repeatable: f32, f16, bf16 (default: every dtype the device supports)")
    common.add_prompt_tokens(p, 512, "prompt length (TTFT)")
    common.add_max_tokens(p, 128, "greedy tokens per run, EOS ignored (decode tok/s)")
    common.add_runs(p, 3, "timed runs per dtype (at least), after one warm-up",
                    max_help="more runs while the decode tok/s CV exceeds 5%%, up to this (default 3 x --runs)")
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default 2)")


def run(s: Settings) -> int:
    from minivllm.bench.activation_dtype import run

    rows = run(s.model, s.inference_device, s.activation_dtype, prompt_tokens=s.prompt_tokens,
               max_tokens=s.max_tokens, repeats=s.runs, max_repeats=s.max_runs, threads=s.threads)
    return 0 if all(r["status"] == "ok" for r in rows) else 1  # a dtype whose child process failed


DRIVER = Driver("activation-dtype", "TTFT, decode tok/s and peak memory per activation dtype (f32, f16, bf16), each "
                "dtype in a fresh process; ratios vs f32", add_arguments, Settings, run)
