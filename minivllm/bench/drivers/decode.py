"""`minivllm bench decode`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    inference_device: list[str] | None
    activation_dtype: list[str] | None
    max_tokens: int
    prompt_tokens: int
    runs: int
    max_runs: int | None
    threads: int | None
    llama_cpp_path: str | None
    no_baselines: bool
    synthetic: str | None
    synthetic_tokenizer: str | None
    option: list[str]
    llama_bench: str | None
    no_eager_row: bool


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p, default=None, help="repeatable: cpu, gpu, cuda:N", repeatable=True)
    common.add_activation_dtype(p, default=None, help="repeatable: f32, f16, bf16", repeatable=True)
    common.add_max_tokens(p, 64, "decode tokens per run")
    common.add_prompt_tokens(p, 512, "prompt length for the prefill measurement")
    common.add_runs(
        p,
        3,
        "rounds of every engine (at least)",
        max_help="more rounds while any engine's decode tok/s CV exceeds 5%%, up to this (default 3 x --runs)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default 2 on CPU)")
    p.add_argument(
        "--llama-cpp-path",
        default=None,
        help="site-packages holding llama-cpp-python (default: $MINIVLLM_LLAMA_CPP_PATH, else the environment)",
    )
    p.add_argument("--no-baselines", action="store_true", help="skip llama.cpp and transformers on CPU")
    common.add_synthetic(p)
    common.add_option(p, "engine option for minivllm (repeatable), e.g. gemv_max_rows=0, enforce_eager=true")
    p.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="a llama-bench binary (llama.cpp CUDA): run it on the same file after minivllm's rounds; "
                        "GPU rows get ratio_vs_llama_cpp")
    p.add_argument("--no-eager-row", action="store_true",
                   help="on a GPU, skip the same weights without CUDA graphs (the minivllm-eager row)")


def run(s: Settings) -> int:
    from minivllm.bench.decode import run

    run(s.model, s.inference_device or ["cpu"], s.activation_dtype or ["f32"], max_tokens=s.max_tokens,
        prompt_tokens=s.prompt_tokens, repeats=s.runs, max_repeats=s.max_runs, threads=s.threads,
        baselines=not s.no_baselines, llama_cpp_path=s.llama_cpp_path, synthetic=s.synthetic,
        synthetic_tokenizer=s.synthetic_tokenizer, engine_options=common.engine_options(s.option),
        llama_bench=s.llama_bench, eager_row=not s.no_eager_row)
    return 0


DRIVER = Driver("decode", "batch-1 decode and 512-token prefill speed; on CPU also llama.cpp and transformers",
                add_arguments, Settings, run)
