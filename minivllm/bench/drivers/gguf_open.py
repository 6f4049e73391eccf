"""`minivllm bench gguf-open`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: list[str] | None
    runs: int
    baseline: bool


def add_arguments(p) -> None:
    common.add_model(p, default=None, help="model name or path (repeatable)", repeatable=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--baseline", action="store_true", help="also time gguf.GGUFReader")


def run(s: Settings) -> int:
    from minivllm.bench.gguf_open import run

    run(s.model or ["smollm2-135m", "qwen2.5-coder-0.5b"], repeats=s.runs, baseline=s.baseline)
    return 0


DRIVER = Driver("gguf-open", "time opening GGUF files (metadata, index, tokenizer)", add_arguments, Settings, run)
