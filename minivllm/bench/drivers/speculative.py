"""`minivllm bench speculative`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    draft_model: str
    inference_device: str
    activation_dtype: str
    runs: int
    max_runs: int | None
    seeds: int
    max_tokens: int
    parts: list[str] | None
    prompts: list[str] | None
    cases: list[str] | None
    sampling_policy: str
    synthetic_pair: bool
    synthetic_tokenizer: str | None
    tv_budgets: tuple[float, ...]
    temperature: float
    option: list[str]


def add_arguments(p) -> None:
    common.add_model(p, "qwen2.5-coder-1.5b", help="the target model")
    p.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    common.add_inference_device(p)
    common.add_activation_dtype(p)
    common.add_runs(p, 3, "timed runs per case (after a warm-up)",
                    max_help="per case, more runs (each of every seed) while a seed's e2e time CV exceeds 5%%, up to "
                             "this (default 3 x --runs)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per run in the sampling table")
    common.add_max_tokens(p, 256, "generated tokens per request (EOS ignored)")
    p.add_argument("--parts", type=lambda v: v.split(","), default=None, help="comma list: greedy, sampling")
    p.add_argument("--prompts", type=lambda v: v.split(","), default=None, help="comma list: code, creative")
    p.add_argument("--cases", type=lambda v: v.split(","), default=None,
                   help="greedy cases to run besides target-only (default all): fixed-4, fixed-6, fixed-8, "
                        "acceptance-rate, accepted-length, adaptive, draft-only")
    p.add_argument(
        "--sampling-policy",
        default="fixed:8",
        help="draft policy of the TV-budget rows; several separated by / (fixed:4/fixed:8) each get every budget",
    )
    p.add_argument("--synthetic-pair", action="store_true",
                   help="synthetic Qwen2.5-7B Q4_K_M target + 0.5B-class draft, random weights (GPU cost study)")
    p.add_argument("--synthetic-tokenizer", default=None, help="GGUF to copy the synthetic models' tokenizer from")
    p.add_argument("--tv-budgets", type=lambda v: tuple(float(x) for x in v.split(",")), default=(0.0, 0.5, 0.75, 1.0))
    p.add_argument("--temperature", type=float, default=0.7)
    common.add_option(p, "engine option for every case (repeatable), e.g. gemv_max_rows=16")


def run(s: Settings) -> int:
    from minivllm.bench.speculative import run

    run(s.model, s.draft_model, s.inference_device, s.activation_dtype, max_tokens=s.max_tokens, runs=s.runs,
        max_runs=s.max_runs, seeds=s.seeds, parts=s.parts, prompts=s.prompts, cases=s.cases,
        sampling_policy=s.sampling_policy, tv_budgets=s.tv_budgets, temperature=s.temperature,
        engine_options=common.engine_options(s.option), synthetic_pair=s.synthetic_pair,
        synthetic_tokenizer=s.synthetic_tokenizer)
    return 0


DRIVER = Driver("speculative", "speculative decoding: target-only vs fixed and adaptive draft lengths (greedy, code "
                "and creative prompts) and mentored decoding's TV budgets (sampling)", add_arguments, Settings, run)
