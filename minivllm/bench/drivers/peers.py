"""`minivllm bench peers`: on CPU minivllm vs transformers and llama-cpp-python (peers.py), on a GPU
batched generation vs transformers' generate (peers_gpu.py)."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver


@dataclass
class Settings:
    model: str
    prompt_tokens: int
    max_tokens: int
    runs: int
    max_runs: int
    threads: int | None
    llama_cpp_path: str | None
    option: list[str]
    inference_device: str
    activation_dtype: list[str] | None
    batch_sizes: str


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_prompt_tokens(p, 128, "prompt tokens for the prefill measurement")
    common.add_max_tokens(p, 64, "greedy tokens decoded one at a time")
    common.add_runs(p, 3, "timed runs per engine (after a warm-up)", max_default=8,
                    max_help="at most this many runs while a CV exceeds 5%%")
    p.add_argument("--threads", type=int, default=None, help="threads for every engine (default: all cores)")
    p.add_argument(
        "--llama-cpp-path",
        default=None,
        help="site-packages holding llama-cpp-python (default: $MINIVLLM_LLAMA_CPP_PATH, else the environment)",
    )
    common.add_option(p, "engine option for minivllm (repeatable; default: the engine's kernel defaults)")
    common.add_inference_device(p, help="cpu (prefill/decode vs transformers and llama-cpp-python), or cuda:N / gpu: "
                                        "batched generation vs transformers' own generate")
    common.add_activation_dtype(
        p,
        default=None,
        repeatable=True,
        help="repeatable. CPU: minivllm rows in these dtypes, f32 (default) and/or bf16 (the fast "
        "mode: int8-activation GEMV, bf16 GEMM); GPU: the one dtype, f16 (default; T4 "
        "has no bf16), bf16, f32",
    )
    p.add_argument("--batch-sizes", default="1,8,32", help="GPU only: comma-separated batch sizes")


def run(s: Settings) -> int:
    if s.inference_device != "cpu":
        from minivllm.bench.peers_gpu import run as run_gpu

        sizes = tuple(int(x) for x in s.batch_sizes.split(",") if x.strip())
        run_gpu(
            s.model,
            s.inference_device,
            (s.activation_dtype or ["f16"])[-1],
            batch_sizes=sizes,
            prompt_len=s.prompt_tokens,
            decode_tokens=s.max_tokens,
            runs=s.runs,
            max_runs=s.max_runs,
            engine_options=common.engine_options(s.option),
        )
        return 0
    from minivllm.bench.peers import run

    run(s.model, prompt_len=s.prompt_tokens, decode_tokens=s.max_tokens, runs=s.runs, threads=s.threads,
        llama_cpp_path=s.llama_cpp_path, engine_options=common.engine_options(s.option), max_runs=s.max_runs,
        dtypes=tuple(s.activation_dtype or ["f32"]))
    return 0


DRIVER = Driver("peers", "CPU prefill and decode tok/s of minivllm vs transformers (and llama-cpp-python when "
                "installed) on the same GGUF file and thread count; ratios vs minivllm", add_arguments, Settings, run)
