"""`minivllm bench stop-strings`: the stop-string matcher with the API's largest stops
(minivllm/bench/stop_string_cost.py)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench.driver import Driver


@dataclass
class Settings:
    max_tokens: int
    runs: int


def add_arguments(p) -> None:
    p.add_argument("--max-tokens", type=int, default=512, help="generated tokens fed to each matcher")
    p.add_argument("--runs", type=int, default=3, help="timed runs per matcher and token size")


def run(s: Settings) -> int:
    from minivllm.bench.stop_string_cost import run

    run(tokens=s.max_tokens, runs=s.runs)
    return 0


DRIVER = Driver("stop-strings", "stop-string matching cost: 16 x 60 KB stops, the old quadratic matcher vs KMP",
                add_arguments, Settings, run)
