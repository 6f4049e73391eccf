"""`bench all`'s plan: one row per benchmark (SUITE), with its command, its `--quick` and full
arguments and how it takes devices (see the package docstring for the modes and placeholders)."""

from __future__ import annotations

from dataclasses import dataclass

NONE, EACH, ALL, PAIR, GPU, CPU = "none", "each", "all", "pair", "gpu", "cpu"


@dataclass(frozen=True)
class Bench:
    """One benchmark of the suite. `quick`/`full` are argument tuples, or dicts with a
    "cpu" and a "cuda" tuple (chosen by whether the run has a CUDA device); `quick=None`
    means full-suite only."""
    name: str
    argv: tuple[str, ...]                       # after `python -m minivllm`
    quick: tuple | dict | None
    full: tuple | dict
    devices: str = EACH
    optional: bool = False                      # run only if `argv` is a registered subcommand
    covers: str = ""                            # the article table(s) it reproduces


_SMALL = "smollm2-135m"
_QWEN05 = "qwen2.5-coder-0.5b"

# fmt: off
SUITE: tuple[Bench, ...] = (
    Bench("gguf-open", ("bench", "gguf-open"),
          quick=("--model", _SMALL, "--runs", "1"),
          full=("--baseline",),
          devices=NONE, covers="load time (no article table)"),
    Bench("decode", ("bench", "decode"),
          quick={"cpu": ("--model", _SMALL, "--activation-dtype", "f32", "--prompt-tokens", "64", "--max-tokens", "16",
                         "--runs", "1", "--no-baselines"),
                 "cuda": ("--model", _SMALL, "--activation-dtype", "f16", "--prompt-tokens", "64", "--max-tokens", "16",
                          "--runs", "1")},
          full={"cpu": ("--model", _SMALL, "--activation-dtype", "f32", "--prompt-tokens", "512",
                        "--max-tokens", "128", "--runs", "3"),
                "cuda": ("--model", _SMALL, "--activation-dtype", "f16", "--prompt-tokens", "512",
                         "--max-tokens", "128", "--runs", "3")},
          devices=EACH, covers="peer table (measured-peers.md): batch-1 prefill/decode vs llama.cpp, transformers"),
    Bench("decode-qwen0.5b", ("bench", "decode"),
          quick=None,
          full={"cpu": ("--model", _QWEN05, "--activation-dtype", "f32", "--prompt-tokens", "512",
                        "--max-tokens", "128", "--runs", "3"),
                "cuda": ("--model", _QWEN05, "--activation-dtype", "f16", "--prompt-tokens", "512",
                         "--max-tokens", "128", "--runs", "3")},
          devices=EACH, covers="peer table: the second model"),
    Bench("decode-7b-synthetic", ("bench", "decode"),
          quick=("--synthetic", "qwen2.5-7b-q4_k_m", "--activation-dtype", "f16", "--prompt-tokens", "64",
                 "--max-tokens", "16", "--runs", "1"),
          full=("--synthetic", "qwen2.5-7b-q4_k_m", "--activation-dtype", "f16", "--prompt-tokens", "512",
                "--max-tokens", "128", "--runs", "3"),
          devices=GPU, covers="peer table (GPU): Qwen2.5-7B Q4_K_M decode vs the roofline"),
    # No dtype arguments: the driver runs every dtype the device supports (bf16 from sm_80).
    Bench("activation-dtype", ("bench", "activation-dtype"),
          quick=("--model", _SMALL, "--prompt-tokens", "32", "--max-tokens", "8", "--runs", "1"),
          full=("--model", _QWEN05, "--prompt-tokens", "512", "--max-tokens", "128", "--runs", "3"),
          devices=EACH, covers="activation dtype (f32/f16/bf16): TTFT, decode tok/s, peak memory, a process per dtype"),
    Bench("gemv-threshold", ("bench", "gemv-threshold"),
          quick=("--concurrency", "1,2", "--max-tokens", "8", "--runs", "1"),
          full={"cpu": ("--concurrency", "1,2,3,4,5,8", "--max-tokens", "32", "--runs", "3", "--batch-invariant"),
                "cuda": ("--activation-dtype", "f16", "--concurrency", "1,2,3,4,5,6,7,8", "--max-tokens", "32",
                         "--runs", "3", "--batch-invariant")},
          devices=EACH, covers="continuous-batching article: unbatched / GEMM / row-wise GEMV by concurrency"),
    Bench("kernels", ("bench", "kernels"),
          quick=("--types", "Q4_K,Q8_0", "--shapes", "3584x3584"),
          full=(),
          devices=GPU, covers="GEMV GB/s per weight type vs copy bandwidth (no article table)"),
    Bench("continuous-batching", ("bench", "continuous-batching"),
          quick=("--parts", "batching", "--concurrency", "1,2", "--max-tokens", "8", "--runs", "1"),
          full=("--parts", "batching"),
          devices=EACH, covers="continuous-batching article: 2 requests batched vs sequential"),
    Bench("paged-vs-contiguous", ("bench", "continuous-batching"),
          quick=("--parts", "kv", "--decode-lengths", "32", "--runs", "1"),
          full={"cpu": ("--parts", "kv", "--decode-lengths", "128,512"),
                "cuda": ("--parts", "kv", "--decode-lengths", "512,2048")},
          devices=EACH, covers="CUDA article: contiguous vs paged KV decode"),
    Bench("scheduling", ("bench", "scheduling"),
          quick=("--runs", "1", "--long-prompts", "2", "--long-tokens", "64", "--fair-prompts", "2",
                 "--fair-tokens", "64", "--max-tokens", "4", "--max-batched-tokens", "32"),
          full=(),
          devices=EACH, covers="scheduling policies: head-of-line TTFT, fairness"),
    Bench("prefix-cache", ("bench", "prefix-cache"),
          quick=("--runs", "1", "--max-tokens", "4", "--groups", "2", "--parts", "single-flight"),
          full={"cpu": (),
                "cuda": ("--model", _QWEN05, "--activation-dtype", "f16")},
          devices=EACH, covers="prefix-cache article: warm prefix, cold burst, incremental, single flight"),
    Bench("speculative", ("bench", "speculative"),
          quick=("--model", _SMALL, "--draft-model", _SMALL, "--max-tokens", "16", "--runs", "1", "--seeds", "1",
                 "--prompts", "code", "--cases", "fixed-4", "--sampling-policy", "fixed:4", "--tv-budgets", "0,1"),
          full={"cpu": (),
                "cuda": ("--synthetic-pair", "--activation-dtype", "f16", "--sampling-policy",
                         "fixed:4/fixed:6/fixed:8")},
          devices=EACH, covers="speculative article: greedy policies; TV-budget break-even"),
    Bench("routing", ("bench", "routing"),
          quick=("--quick",),
          full={"cpu": (), "cuda": ("--model", _QWEN05)},
          devices=PAIR, covers="routing article: forced-fastest vs cost, bursts of 8 and 48"),
    Bench("disaggregation", ("bench", "disaggregation"),
          quick=("--quick",),
          full={"cpu": (), "cuda": ("--model", _QWEN05)},
          devices=PAIR, covers="article 2's closing question: GPU prefill, CPU decode, the break-even formula"),
    Bench("smoke", ("smoke",),
          quick=("--max-tokens", "16", "--json", "{results}/smoke-{tag}-{stamp}.json"),
          full=("--model", _QWEN05, "--max-tokens", "128", "--json", "{results}/smoke-{tag}-{stamp}.json"),
          devices=ALL, covers="CUDA article: smoke table, one request per worker"),
    Bench("soak", ("bench", "soak"),
          quick=("--requests", "40", "--max-tokens", "8", "--max-prompt-tokens", "64", "--burst", "5,15",
                 "--gap", "0.1,0.5", "--max-model-len", "512", "--max-rss-growth", "0"),
          full=(),
          devices=PAIR, covers="robustness (no article table)"),
    Bench("serve", ("bench", "serve"),
          quick=("--start-server", "--model", _SMALL, "--num-prompts", "8", "--prompt-tokens", "32",
                 "--max-tokens", "8"),
          full=("--start-server", "--model", _QWEN05, "--num-prompts", "200", "--prompt-tokens", "512",
                "--max-tokens", "128", "--request-rate", "4"),
          devices=ALL, covers="online serving load: TTFT/TPOT/ITL/goodput (no article table)"),
    Bench("admission", ("bench", "admission"),
          quick=("--rounds", "1"),
          full=("--rounds", "3"),
          devices=CPU,
          covers="work-aware admission: short-request TTFT under a burst of long prompts (no article table)"),
    Bench("stop-strings", ("bench", "stop-strings"),
          quick=("--max-tokens", "128", "--runs", "1"),
          full=(),
          devices=NONE, covers="stop-string matcher cost, 16 x 60 KB stops (no article table)"),
    Bench("structured", ("bench", "structured"),
          quick=("--model", _SMALL, "--max-tokens", "16", "--runs", "1", "--batches", "1,4"),
          full={"cpu": ("--model", _SMALL, "--max-tokens", "64", "--runs", "3"),
                "cuda": ("--model", _QWEN05, "--activation-dtype", "f16", "--max-tokens", "64", "--runs", "3")},
          devices=EACH,
          covers="structured output: JSON-schema rows vs unconstrained, batch 1 and 16 (no article table)"),
    Bench("offline", ("bench", "offline"),
          quick=("?--quick",),
          full={"cpu": ("--num-seqs", "32", "--prompt-tokens-range", "64:256", "--max-tokens-range", "64:256"),
                # 256 requests in flight at once, as nano-vllm's bench does; f16 (T4 has no bf16).
                "cuda": ("--activation-dtype", "f16", "--option", "max_active_requests=256",
                         "--option", "max_batched_tokens=8192")},
          devices=EACH, optional=True, covers="offline throughput, nano-vllm's workload (no article table)"),
    Bench("peers", ("bench", "peers"),
          quick=("--prompt-tokens", "32", "--max-tokens", "8", "--runs", "1"),
          full=("--prompt-tokens", "512", "--max-tokens", "128", "--runs", "3"),
          devices=CPU, optional=True, covers="peer table (measured-peers.md): CPU vs transformers and llama.cpp"),
    Bench("peers-gpu", ("bench", "peers"),
          quick=("--batch-sizes", "1,4", "--prompt-tokens", "32", "--max-tokens", "8", "--runs", "1"),
          full=("--batch-sizes", "1,8,32,64", "--prompt-tokens", "128", "--max-tokens", "128", "--runs", "3"),
          devices=GPU, covers="peers on a GPU: batched generation vs transformers' own generate"),
    # Last, so the figures draw the result files the runs above just wrote.
    Bench("plot", ("bench", "plot"),
          quick=(),
          full=(),
          devices=NONE, covers="benchmarks/plots/*.png: figures of the newest result files"),
)
# fmt: on

# `minivllm bench` subcommands deliberately not in SUITE, with the reason.
# (`bench all` itself is not a registered driver: it reads the registry.)
EXCLUDED: dict[str, str] = {}

# Measurements the issue asks for that no driver makes yet (listed in the index).
NOT_IMPLEMENTED: dict[str, str] = {}


def by_name() -> dict[str, Bench]:
    return {b.name: b for b in SUITE}
