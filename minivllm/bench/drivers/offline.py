"""`minivllm bench offline`."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.bench import common
from minivllm.bench.driver import Driver

length_range = common.range_type(":", int, 1)


@dataclass
class Settings:
    model: str
    inference_device: str
    activation_dtype: str
    num_seqs: int
    prompt_tokens_range: tuple[int, int]
    max_tokens_range: tuple[int, int]
    seed: int
    runs: int
    max_runs: int
    cv_target: float
    threads: int | None
    max_seconds: float | None
    no_warmup: bool
    quick: bool
    option: list[str]
    llama_batched_bench: str | None


def add_arguments(p) -> None:
    common.add_model(p)
    common.add_inference_device(p)
    common.add_activation_dtype(p)
    p.add_argument("--num-seqs", type=int, default=256, help="requests (default 256)")
    p.add_argument("--prompt-tokens-range", type=length_range, default=(100, 1024), metavar="A:B",
                   help="prompt tokens, uniform in [A, B] (default 100:1024)")
    p.add_argument("--max-tokens-range", type=length_range, default=(100, 1024), metavar="A:B",
                   help="output tokens, uniform in [A, B], produced exactly (default 100:1024)")
    p.add_argument("--seed", type=int, default=0)
    common.add_runs(p, 3, "timed runs, each on a fresh engine (after one warm-up)", max_default=8,
                    max_help="more runs while the CV of output tok/s exceeds --cv-target")
    p.add_argument("--cv-target", type=float, default=0.05)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="start no run that would end past this many seconds of timed runs (results are written "
                        "after every run)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--quick", action="store_true", help="16 requests, lengths 32:128, 1 run + warm-up (CI, smoke)")
    common.add_option(p, "engine option (repeatable), e.g. max_active_requests=64, max_batched_tokens=2048")
    p.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                   help="instead of the workload above: batched decode of 1, 8 and 32 sequences (128 prompt + 128 "
                        "output tokens) on a GPU, beside this llama-batched-bench binary's S_TG on the same file "
                        "(bench/llama_batched_bench.py)")


def run(s: Settings) -> int:
    if s.llama_batched_bench is not None:
        return _batched_peer(s)
    from minivllm.bench.offline import run

    run(s.model, s.inference_device, s.activation_dtype, num_seqs=s.num_seqs, input_len_range=s.prompt_tokens_range,
        output_len_range=s.max_tokens_range, seed=s.seed, runs=s.runs, max_runs=s.max_runs, cv_target=s.cv_target,
        quick=s.quick, threads=s.threads, engine_options=common.engine_options(s.option), warmup=not s.no_warmup,
        max_seconds=s.max_seconds)
    return 0


def _batched_peer(s: Settings) -> int:
    from minivllm.bench.llama_batched_bench import compare
    from minivllm.bench.results import write_results
    from minivllm.models import resolve_model

    path = resolve_model(s.model, progress=False)
    result = compare(path, s.llama_batched_bench, engine_options=common.engine_options(s.option))
    rows = [{"engine": "minivllm", **{k: v for k, v in r.items() if k != "samples"}} for r in result["minivllm"]]
    rows += [{k: v for k, v in r.items() if k != "raw"} for r in result["llama_cpp"]]
    cols = ["engine", "sequences", "prompt_tokens", "decode_tokens", "decode_tok_s", "llama_cpp_decode_tok_s",
            "ratio_vs_llama_cpp", "status"]
    write_results(f"offline-batched-vs-llama-cpp-{common.model_label(s.model)}", result["meta"], rows, cols,
                  "Batched decode: minivllm's decode rate beside llama-batched-bench's S_TG on the same file. "
                  + result["meta"]["minivllm_measure"] + "; " + result["meta"]["llama_cpp_measure"] + ".")
    return 0


DRIVER = Driver("offline", "offline throughput: N random-token requests (lengths uniform in ranges, EOS ignored) "
                "submitted at once; output/total tok/s, requests/s, mean ± std over fresh engines",
                add_arguments, Settings, run)
