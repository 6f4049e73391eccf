"""Single-request (batch-1) decode and 512-token prefill speed, against llama.cpp and transformers.

Every engine gets the same token ids: a `prompt_tokens`-long prompt cut from the prompts in
data/prompts.json (joined and repeated until long enough), then exactly `decode_tokens`
greedy tokens (EOS ignored). Measured the same way for each engine:

* prefill tok/s = prompt tokens / (time from submitting the prompt to the first token
  chosen) — one forward over the whole prompt plus one argmax;
* decode tok/s = (decode_tokens - 1) / (time from the first token to the last).

minivllm runs through its engine (`RequestMetrics`: queue time excluded, one prefill chunk
since max_batched_tokens >= prompt tokens). On the CPU the same GGUF file also runs through
llama-cpp-python (optional; `--llama-cpp-path` / $MINIVLLM_LLAMA_CPP_PATH adds its
site-packages to sys.path; "not installed" otherwise) and transformers
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`, float32, its KV cache), all
with the same thread count. All engines stay loaded and take turns inside every repeat, so
each ours/theirs ratio compares numbers measured next to each other. After `repeats` rounds,
whole rounds continue while any engine's decode tok/s varies by more than 5% (coefficient of
variation), up to `max_repeats` rounds (`common.runs_until_stable`).

`synthetic="qwen2.5-7b-q4_k_m"` measures the synthetic Qwen2.5-7B Q4_K_M file
(minivllm/bench/synthetic_model.py), written to the model cache on first use; GPU only.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from minivllm.bench.common import (
    CV_TARGET,
    common_prefix,
    loadavg,
    model_label,
    provenance,
    record_stat,
    runs_until_stable,
)
from minivllm.bench.continuous_batching import PROMPTS_FILE
from minivllm.bench.results import write_results
from minivllm.devices import resolve_device
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.kernels.fallbacks import fallbacks
from minivllm.models.cache import sha256_file
from minivllm.sampling.sampling_params import SamplingParams

LLAMA_CPP_ENV = "MINIVLLM_LLAMA_CPP_PATH"
DEFAULT_CPU_THREADS = 2


def long_prompt_ids(tokenizer, n_tokens: int) -> list[int]:
    """Exactly `n_tokens` ids: the prompt file's prompts joined by blank lines, repeated as needed."""
    import json

    text = "\n\n".join(json.loads(PROMPTS_FILE.read_text())["prompts"])
    if not tokenizer.encode(text):
        raise ConfigError("prompts", str(PROMPTS_FILE), "the prompt file encodes to no tokens")
    copies = 1
    while len(ids := tokenizer.encode("\n\n".join([text] * copies))) < n_tokens:
        copies *= 2
    return ids[:n_tokens]


# --- engines under test ------------------------------------------------------------------
# Each runner's `measure(ids, n)` returns (prefill seconds, decode seconds, generated ids).


class MinivllmRunner:
    def __init__(self, model_path: Path, device: str, dtype: str, max_len: int, prompt_tokens: int,
                 engine_options: dict | None = None):
        # Prefix cache off unless asked for: every run submits the same ids, and with it on every
        # run after the first restores the prompt's full pages instead of computing them (the
        # prefill would time a cache hit: 48 of 64 tokens restored on SmolLM2).
        options = {"prefix_cache": False, **(engine_options or {})}
        self.llm = LLM(str(model_path), device=device, dtype=dtype, progress=False, max_model_len=max_len,
                       max_batched_tokens=max(512, prompt_tokens), max_active_requests=1, **options)
        self.device, self.dtype = str(resolve_device(device)), dtype
        self.engine = "minivllm"

    def measure(self, ids: list[int], n: int) -> tuple[float, float, list[int]]:
        out = self.llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
        m = out.metrics
        if len(out.token_ids) != n:
            raise RuntimeError(f"minivllm produced {len(out.token_ids)} tokens, expected {n}")
        self.cached_prompt_tokens = m.cached_prompt_tokens  # 0 unless the prefix cache was asked for
        return m.time_to_first_token_s - m.queue_time_s, m.e2e_s - m.time_to_first_token_s, list(out.token_ids)

    def kernels(self) -> object:
        return self.llm.snapshot().get("kernels")


class LlamaCppRunner:
    engine = "llama.cpp"
    dtype = "f32 activations (ggml)"

    def __init__(self, module, model_path: Path, threads: int, max_len: int, prompt_tokens: int):
        self.lib = module
        self.llm = module.Llama(model_path=str(model_path), n_ctx=max_len, n_batch=max(512, prompt_tokens),
                                n_ubatch=max(512, prompt_tokens), n_threads=threads, n_threads_batch=threads,
                                n_gpu_layers=0, verbose=False)
        self.device = "cpu"
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def measure(self, ids: list[int], n: int) -> tuple[float, float, list[int]]:
        self.llm.reset()  # drop the previous repeat's tokens (and their KV cells, on the next eval)
        t0 = time.perf_counter()
        self.llm.eval(ids)
        out = [self._argmax()]
        t1 = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([out[-1]])
            out.append(self._argmax())
        return t1 - t0, time.perf_counter() - t1, out


class TransformersRunner:
    engine = "transformers"
    dtype = "f32"

    def __init__(self, model_path: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                          dtype=torch.float32, local_files_only=True).eval()
        self.device = "cpu"

    @torch.inference_mode()
    def measure(self, ids: list[int], n: int) -> tuple[float, float, list[int]]:
        t0 = time.perf_counter()
        res = self.model(input_ids=torch.tensor([ids]), use_cache=True)
        out = [int(torch.argmax(res.logits[0, -1]))]
        t1 = time.perf_counter()
        cache = res.past_key_values
        for _ in range(n - 1):
            res = self.model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            out.append(int(torch.argmax(res.logits[0, -1])))
        return t1 - t0, time.perf_counter() - t1, out


def load_llama_cpp(path: str | None = None):
    """(module, None), or (None, why not) when llama-cpp-python cannot be imported."""
    path = path or os.environ.get(LLAMA_CPP_ENV)
    if path:
        if not Path(path).is_dir():
            return None, f"not installed: {path} is not a directory"
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module("llama_cpp"), None
    except ImportError:
        return None, f"not installed (pip install llama-cpp-python, or set {LLAMA_CPP_ENV} / --llama-cpp-path)"
    except OSError as exc:  # the package is there but its shared library does not load
        return None, f"not importable: {exc}"


# --- the benchmark -----------------------------------------------------------------------


def run(model: str = "smollm2-135m", devices: list[str] | None = None, dtypes: list[str] | None = None, *,
        max_tokens: int = 64, prompt_tokens: int = 512, repeats: int = 3, max_repeats: int | None = None,
        threads: int | None = None, baselines: bool = True, llama_cpp_path: str | None = None,
        synthetic: str | None = None, synthetic_tokenizer: str | None = None,
        engine_options: dict | None = None, llama_bench: str | None = None, eager_row: bool = True) -> list[dict]:
    """One row per (device, dtype) of minivllm, plus llama.cpp and transformers rows when a
    device is the CPU and `baselines`. `max_tokens`: decode tokens per run. `max_repeats`
    (default 3 x repeats): the most rounds when the decode tok/s CV stays above 5%."""
    devices, dtypes = devices or ["cpu"], dtypes or ["f32"]
    if max_tokens < 2:
        raise ConfigError("max_tokens", max_tokens, "must be >= 2 (decode speed needs tokens after the first)")
    if prompt_tokens < 1 or repeats < 1:
        raise ConfigError(
            "prompt_tokens" if prompt_tokens < 1 else "repeats", min(prompt_tokens, repeats), "must be >= 1"
        )
    max_repeats = 3 * repeats if max_repeats is None else max_repeats
    if max_repeats < repeats:
        raise ConfigError("max_repeats", max_repeats, f"must be >= repeats ({repeats})")
    on_cpu = any(resolve_device(d).type == "cpu" for d in devices)
    if synthetic is not None:
        if on_cpu:
            raise ConfigError("inference_device", "cpu", "the synthetic 7B model is for GPU runs (its float32 weights "
                              "would need ~30 GB of host memory); use --inference-device gpu")
        from minivllm.bench.synthetic_model import ensure_synthetic_model

        model_path = ensure_synthetic_model(synthetic, tokenizer_source=synthetic_tokenizer)
        label = f"synthetic-{synthetic}"
    else:
        from minivllm.models import resolve_model

        model_path, label = Path(resolve_model(model, progress=False)), model_label(model)
    if threads is None and on_cpu:
        threads = DEFAULT_CPU_THREADS
    if threads is not None:
        torch.set_num_threads(threads)
    load_start = loadavg()
    max_len = prompt_tokens + max_tokens + 8

    runners: list = []
    for d in devices:
        for dt in dtypes:
            r = MinivllmRunner(model_path, d, dt, max_len, prompt_tokens, engine_options)
            runners.append(r)
            if eager_row and resolve_device(d).type == "cuda" and not (engine_options or {}).get("enforce_eager"):
                # The same weights without CUDA graphs: what the graphs are worth, same run.
                eager = object.__new__(MinivllmRunner)
                eager.llm, eager.device, eager.dtype = r.llm.fork(enforce_eager=True), r.device, r.dtype
                eager.engine = "minivllm-eager"
                runners.append(eager)
    ids = long_prompt_ids(runners[0].llm.tokenizer, prompt_tokens)
    skipped: list[dict] = []
    versions: dict[str, str] = {}
    if baselines and on_cpu:
        lib, why = load_llama_cpp(llama_cpp_path)
        if lib is None:
            skipped.append({"engine": "llama.cpp", "device": "cpu", "dtype": LlamaCppRunner.dtype, "status": why})
        else:
            runners.append(LlamaCppRunner(lib, model_path, threads, max_len, prompt_tokens))
            versions["llama_cpp_python"] = getattr(lib, "__version__", "?")
        import transformers

        runners.append(TransformersRunner(model_path))
        versions["transformers"] = transformers.__version__

    for r in runners:  # warm-up: kernels compiled, caches allocated, pages touched
        r.measure(ids, min(4, max_tokens))

    def one_round() -> list[tuple[float, float, list[int]]]:  # every engine once, one after another
        measured = []
        for r in runners:
            measured.append(r.measure(ids, max_tokens))
            _sync(r.device)
        return measured

    rounds = runs_until_stable(one_round, min_runs=repeats, max_runs=max_repeats, cv_target=CV_TARGET,
                               key=lambda measured: [(max_tokens - 1) / td for _, td, _ in measured])
    prefill = [[prompt_tokens / measured[i][0] for measured in rounds.samples] for i in range(len(runners))]
    decode = [[(max_tokens - 1) / measured[i][1] for measured in rounds.samples] for i in range(len(runners))]
    tokens = [rounds.samples[-1][i][2] for i in range(len(runners))]

    rows = []
    for i, r in enumerate(runners):
        row = {"engine": r.engine, "device": r.device, "dtype": r.dtype, "status": "ok",
               "prompt_tokens": prompt_tokens, "decode_tokens": max_tokens}
        record_stat(row, "prefill_tok_s", prefill[i])
        record_stat(row, "decode_tok_s", decode[i])
        row["runs"], row["decode_tok_s_cv"] = rounds.runs, rounds.cvs[i]
        # Same greedy tokens as minivllm's first row: evidence that all engines ran the same model.
        row["same_tokens_as_first_row"] = common_prefix(tokens[i], tokens[0])
        if isinstance(r, MinivllmRunner):
            row["kernels"] = r.kernels()
            row["kernel_fallbacks"] = fallbacks()  # kernels that could not run here: not their numbers
            if row["kernel_fallbacks"]:
                row["status"] = "degraded: " + "; ".join(row["kernel_fallbacks"]) + " fell back"
            row["cached_prompt_tokens"] = r.cached_prompt_tokens  # last run's; 0: the prefill computed every token
            row["engine_options"] = dict(engine_options or {})
        row["samples"] = {"prefill_tok_s": prefill[i], "decode_tok_s": decode[i]}
        rows.append(row)
    ours_cpu = next((row for row in rows if row["engine"] == "minivllm" and row["device"] == "cpu"), None)
    for row in rows:  # CUDA graphs vs eager on the same weights
        if row["engine"] == "minivllm-eager":
            graphed = next(g for g in rows if g["engine"] == "minivllm" and g["device"] == row["device"]
                           and g["dtype"] == row["dtype"])
            graphed["graphs/eager_decode"] = graphed["decode_tok_s_median"] / row["decode_tok_s_median"]
    for row in rows + skipped:
        if row["engine"] != "minivllm" and ours_cpu is not None and row["status"] == "ok":
            row["minivllm/this_decode"] = ours_cpu["decode_tok_s_median"] / row["decode_tok_s_median"]
            row["minivllm/this_prefill"] = ours_cpu["prefill_tok_s_median"] / row["prefill_tok_s_median"]
    rows += skipped
    if llama_bench is not None:  # llama.cpp's CUDA backend on the same file, after our rounds (bench/llama_bench.py)
        from minivllm.bench.llama_bench import add_ratios, llama_bench_rows

        rows += llama_bench_rows(llama_bench, model_path, prompt_tokens, max_tokens)
        add_ratios(rows)
    for row in rows:
        print(f"{row['engine']:>12} {row['device']:>7} {row['dtype']}: {row['status']}"
              + (f"; prefill {row['prefill_tok_s']} tok/s, decode {row['decode_tok_s']} tok/s"
                 if "decode_tok_s" in row else ""), flush=True)

    settings = {"model": str(model_path) if synthetic else model, "synthetic": synthetic, "devices": devices,
                "dtypes": dtypes, "prompt_tokens": prompt_tokens, "decode_tokens": max_tokens, "repeats": repeats,
                "max_repeats": max_repeats, "cv_target": CV_TARGET, "rounds": rounds.info(),
                "minivllm_prefix_cache": bool((engine_options or {}).get("prefix_cache", False)),
                "threads": threads, "torch_threads": torch.get_num_threads(), "baselines": baselines and on_cpu,
                "sampling": "greedy (argmax), EOS ignored", "prompt_source": str(PROMPTS_FILE.name),
                "warmup": f"one {min(4, max_tokens)}-token run per engine",
                "engine_options": dict(engine_options or {}), **versions}
    if llama_bench is not None:
        settings["llama_bench"] = {"binary": llama_bench, "command": next(
            (r.get("llama_bench_command") for r in rows if r["engine"] == "llama.cpp-cuda"), None)}
    first_dev = str(runners[0].llm.model.device)
    meta = provenance(first_dev, sha256_file(model_path), settings)
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    note = (f"Batch 1: a {prompt_tokens}-token prompt (from {PROMPTS_FILE.name}), then {max_tokens} greedy tokens. "
            f"prefill tok/s = prompt tokens / (prompt submitted -> first token); decode tok/s = "
            f"({max_tokens} - 1) / (first -> last token). Mean ± sample std over {rounds.runs} runs after a warm-up "
            f"(at least {repeats}; more while a decode tok/s CV exceeded {CV_TARGET:.0%}, at most {max_repeats}: "
            f"{rounds.stopped}); "
            f"medians in the *_median columns; ratios are of medians. Engines take turns within each run"
            + (f"; CPU threads: {threads}" if threads else "") + ". 'same_tokens_as_first_row': length of the greedy "
            f"output shared with the first row (f32 engines on the same file should agree for a while). Load "
            f"average (1/5/15 min) at start {load_start}, end {meta['load_average_1_5_15']['end']}.")
    cols = ["engine", "device", "dtype", "status", "prompt_tokens", "decode_tokens", "prefill_tok_s",
            "prefill_tok_s_median", "decode_tok_s", "decode_tok_s_median", "decode_tok_s_cv", "runs",
            "minivllm/this_prefill",
            "minivllm/this_decode", "graphs/eager_decode", "same_tokens_as_first_row"]
    if llama_bench is not None:
        cols += ["ratio_vs_llama_cpp", "ratio_vs_llama_cpp_prefill", "llama_cpp_commit"]
    _, md = write_results(f"decode-{label}", meta, rows, cols, note)
    print(md.read_text(), flush=True)
    return rows


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


