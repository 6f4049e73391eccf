"""`minivllm bench admission`: long prompts against short ones, with and without the
queued-prompt-token limit (minivllm/bench/admission_burst.py)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    rounds: int
    limit: int


def add_arguments(p) -> None:
    common.add_model(p, default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs both settings, alternating")
    p.add_argument("--limit", type=int, default=1024,
                   help="max_queued_prompt_tokens of the limited setting (the other has none)")


def run(s: Settings) -> int:
    from minivllm.bench.admission_burst import run

    run(rounds=s.rounds, limit=s.limit, model=s.model)
    return 0


DRIVER = Driver("admission", "a burst of long prompts vs short ones, with and without max_queued_prompt_tokens",
                add_arguments, Settings, run)
