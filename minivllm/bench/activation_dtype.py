"""What the activation dtype (f32, f16, bf16) costs and buys: TTFT, decode tok/s, peak memory.

One model, one device; every dtype runs in a fresh `python -m minivllm.bench.activation_dtype
--child CASE` process, so its peak memory is its own (a process that had loaded the f32
model first would report f32's peak for every later dtype). The child, like `bench decode`'s
minivllm runner (batch 1, one prefill chunk):

* loads the model, then one warm-up run, then timed runs of a `prompt_tokens`-long prompt
  (cut from data/prompts.json) and `max_tokens` greedy tokens, EOS ignored: at least
  `repeats` runs, more while the CV of decode tok/s exceeds 5%, at most `max_repeats`;
* TTFT = prompt submitted -> first token chosen, queue time excluded (RequestMetrics);
  decode tok/s = (max_tokens - 1) / (first token -> last token);
* peak memory per phase (bench/peak_memory.py): after imports, during the model load and
  during generation (warm-up and timed runs), and what stays resident after the load;
* prints one JSON line: samples, greedy tokens, memory.

The parent checks every dtype against the device first (bf16 needs sm_80 on CUDA), runs the
children one after another, and writes one row per dtype with ratios against the f32 row
and the number of leading greedy tokens each dtype shares with f32.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
from minivllm.bench.decode import DEFAULT_CPU_THREADS, MinivllmRunner, long_prompt_ids
from minivllm.bench.peak_memory import PeakMemory
from minivllm.bench.results import write_results
from minivllm.devices import DTYPE_CHOICES, check_dtype_supported, dtype_name, resolve_device, resolve_dtype
from minivllm.errors import ConfigError, DeviceError

REFERENCE = "f32"
MIB = 1 << 20
CHILD_FLAG = "--child"


# --- which dtypes ------------------------------------------------------------------------


def device_supports(device: torch.device, dtype: str) -> bool:
    try:
        check_dtype_supported(device, resolve_dtype(dtype))
    except DeviceError:
        return False
    return True


def checked_dtypes(device: torch.device, requested: list[str] | None) -> list[str]:
    """Canonical names (f32/f16/bf16), each once; by default every dtype the device supports.
    An unknown name or one the device cannot run is a ConfigError naming it and the fix."""
    if not requested:
        return [d for d in DTYPE_CHOICES if device_supports(device, d)]
    out: list[str] = []
    for name in requested:
        dtype = resolve_dtype(name)  # ConfigError for an unknown name, listing the allowed ones
        try:
            check_dtype_supported(device, dtype)
        except DeviceError as exc:
            raise ConfigError("activation_dtype", name, str(exc)) from None
        if dtype_name(dtype) not in out:
            out.append(dtype_name(dtype))
    return out


# --- the child: one dtype in this process --------------------------------------------------


def measure_case(case: dict) -> dict:
    """Load, warm up, time, measure memory; everything the parent's row needs."""
    device = torch.device(case["device"])
    if case["threads"] is not None:
        torch.set_num_threads(case["threads"])
    memory = PeakMemory(device)
    phases = {"imports": memory.phase()}
    memory.reset()
    prompt_tokens, max_tokens = case["prompt_tokens"], case["max_tokens"]
    runner = MinivllmRunner(Path(case["model_path"]), case["device"], case["dtype"],
                            prompt_tokens + max_tokens + 8, prompt_tokens)
    phases["load"] = memory.phase()
    memory.reset()
    ids = long_prompt_ids(runner.llm.tokenizer, prompt_tokens)

    def run_once() -> dict:
        ttft_s, decode_s, tokens = runner.measure(ids, max_tokens)
        return {"ttft_ms": 1000 * ttft_s, "decode_tok_s": (max_tokens - 1) / decode_s, "tokens": tokens,
                "cached_prompt_tokens": runner.cached_prompt_tokens}

    run_once()  # warm-up at full size: kernels compiled, every KV page and buffer touched
    runs = runs_until_stable(run_once, min_runs=case["repeats"], max_runs=case["max_repeats"],
                             cv_target=CV_TARGET, key="decode_tok_s")
    phases["generate"] = memory.phase()
    tokens = [s["tokens"] for s in runs.samples]
    return {"dtype": case["dtype"], "device": str(device), "ttft_ms": [s["ttft_ms"] for s in runs.samples],
            "decode_tok_s": [s["decode_tok_s"] for s in runs.samples], "runs": runs.info(),
            "tokens": tokens[-1], "tokens_same_every_run": all(t == tokens[0] for t in tokens),
            # 0 unless a run's prompt came from the prefix cache (MinivllmRunner turns it off)
            "cached_prompt_tokens": max(s["cached_prompt_tokens"] for s in runs.samples),
            "memory_method": memory.method, "memory_resets_per_phase": memory.resets_per_phase, "memory": phases,
            "weights_mib": runner.llm.model.weight_bytes() / MIB,
            "kv_pool_mib": runner.llm.engine.pool.snapshot()["bytes"] / MIB,
            "torch_threads": torch.get_num_threads(), "kernels": runner.kernels()}


def run_child(case: dict) -> dict:
    """`measure_case` in a fresh interpreter; raises RuntimeError with its stderr when it fails."""
    proc = subprocess.run([sys.executable, "-m", __name__, CHILD_FLAG, json.dumps(case)],
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise RuntimeError(f"the {case['dtype']} child process failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


# --- the parent: one row per dtype ---------------------------------------------------------


def _row(result: dict, prompt_tokens: int, max_tokens: int) -> dict:
    phases = result["memory"]
    row = {"dtype": result["dtype"], "device": result["device"], "status": "ok", "prompt_tokens": prompt_tokens,
           "decode_tokens": max_tokens}
    record_stat(row, "ttft_ms", result["ttft_ms"])
    record_stat(row, "decode_tok_s", result["decode_tok_s"])
    row["runs"], row["decode_tok_s_cv"] = result["runs"]["runs"], result["runs"]["cv"]
    # Peak total: the highest phase peak (with per-phase resets no single counter holds it).
    row["peak_mib"] = max(p["peak_mib"] for p in phases.values())
    row["load_peak_mib"], row["generate_peak_mib"] = phases["load"]["peak_mib"], phases["generate"]["peak_mib"]
    row["after_load_mib"] = phases["load"]["resident_mib"]
    if "reserved_peak_mib" in phases["load"]:
        row["reserved_peak_mib"] = max(p["reserved_peak_mib"] for p in phases.values())
    for key in ("weights_mib", "kv_pool_mib", "memory_method", "memory_resets_per_phase", "memory", "tokens",
                "tokens_same_every_run", "cached_prompt_tokens", "torch_threads", "kernels"):
        row[key] = result[key]
    row["runs_info"] = result["runs"]
    row["samples"] = {"ttft_ms": result["ttft_ms"], "decode_tok_s": result["decode_tok_s"]}
    return row


def _compare_with_reference(rows: list[dict]) -> None:
    ref = next((r for r in rows if r["dtype"] == REFERENCE and r["status"] == "ok"), None)
    if ref is None:
        return
    for r in rows:
        if r["status"] != "ok":
            continue
        r["decode/f32"] = r["decode_tok_s_median"] / ref["decode_tok_s_median"]
        r["ttft/f32"] = r["ttft_ms_median"] / ref["ttft_ms_median"]
        r["peak_mem/f32"] = r["peak_mib"] / ref["peak_mib"]
        # Evidence that every dtype ran the same model: greedy outputs agree for a while.
        r["same_tokens_as_f32"] = common_prefix(r["tokens"], ref["tokens"])


def run(model: str = "smollm2-135m", device: str = "cpu", dtypes: list[str] | None = None, *,
        prompt_tokens: int = 512, max_tokens: int = 128, repeats: int = 3, max_repeats: int | None = None,
        threads: int | None = None) -> list[dict]:
    """One row per dtype; writes activation-dtype-<model>-<device>-<stamp>.{json,md}. A dtype whose
    child process fails gets a "failed: ..." row; the others still run."""
    from minivllm.models import resolve_model
    from minivllm.models.cache import sha256_file

    if max_tokens < 2:
        raise ConfigError("max_tokens", max_tokens, "must be >= 2 (decode speed needs tokens after the first)")
    if prompt_tokens < 1 or repeats < 1:
        raise ConfigError("prompt_tokens" if prompt_tokens < 1 else "repeats", min(prompt_tokens, repeats),
                          "must be >= 1")
    max_repeats = 3 * repeats if max_repeats is None else max_repeats
    if max_repeats < repeats:
        raise ConfigError("max_repeats", max_repeats, f"must be >= repeats ({repeats})")
    dev = resolve_device(device)  # "gpu" becomes one cuda:N, the same for every child
    dtypes = checked_dtypes(dev, dtypes)
    if threads is None and dev.type == "cpu":
        threads = DEFAULT_CPU_THREADS
    if threads is not None:
        torch.set_num_threads(threads)  # the children's count, also named in the provenance's device
    model_path = Path(resolve_model(model, progress=False))
    load_start = loadavg()

    rows = []
    for dt in dtypes:
        case = {"model_path": str(model_path), "device": str(dev), "dtype": dt, "prompt_tokens": prompt_tokens,
                "max_tokens": max_tokens, "repeats": repeats, "max_repeats": max_repeats, "threads": threads}
        try:
            row = _row(run_child(case), prompt_tokens, max_tokens)
        except RuntimeError as exc:
            print(exc, file=sys.stderr, flush=True)
            row = {"dtype": dt, "device": str(dev), "status": f"failed: {str(exc).splitlines()[-1]}"}
        rows.append(row)
        print(f"{dt}: {row['status']}" + (f"; TTFT {row['ttft_ms']} ms, decode {row['decode_tok_s']} tok/s, "
                                          f"peak {row['peak_mib']:.0f} MiB" if row["status"] == "ok" else ""),
              flush=True)
    _compare_with_reference(rows)

    first_ok = next((r for r in rows if r["status"] == "ok"), {})
    settings = {"model": model, "model_path": str(model_path), "device": str(dev), "dtypes": dtypes,
                "prompt_tokens": prompt_tokens, "decode_tokens": max_tokens, "repeats": repeats,
                "max_repeats": max_repeats, "cv_target": CV_TARGET, "threads": threads,
                "sampling": "greedy (argmax), EOS ignored", "prompt_source": PROMPTS_FILE.name,
                "warmup": f"one full-size run ({prompt_tokens}-token prompt, {max_tokens} tokens) per dtype",
                "process_per_dtype": f"{sys.executable} -m {__name__} {CHILD_FLAG} CASE",
                "engine": {"max_active_requests": 1, "max_batched_tokens": max(512, prompt_tokens),
                           "max_model_len": prompt_tokens + max_tokens + 8, "prefix_cache": False},
                "memory_method": first_ok.get("memory_method")}
    meta = provenance(str(dev), sha256_file(model_path), settings)
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    on_cuda = dev.type == "cuda"
    note = (f"Batch 1, device {meta['device']}: a {prompt_tokens}-token prompt (from {PROMPTS_FILE.name}), then "
            f"{max_tokens} greedy tokens (EOS ignored); each dtype in its own fresh process, one full-size warm-up, "
            f"then at least {repeats} timed runs (more while the decode tok/s CV exceeded {CV_TARGET:.0%}, at most "
            f"{max_repeats}). TTFT = prompt submitted -> first token (queue time excluded); decode tok/s = "
            f"({max_tokens} - 1) / (first -> last token); mean ± sample std, medians in *_median. Memory ("
            + ("allocator bytes: torch.cuda.max_memory_allocated, CUDA context excluded; reserved_peak_mib is the "
               "caching allocator's pool" if on_cuda else "process RSS: VmHWM, reset between phases via "
               "/proc/self/clear_refs where possible")
            + f"; method per row in the JSON): load_peak_mib during the model load, after_load_mib resident after "
            f"it, generate_peak_mib during warm-up and timed runs, peak_mib the highest. Ratios are of medians (and "
            f"peaks) against the f32 row; same_tokens_as_f32 = leading greedy tokens shared with f32. Load average "
            f"(1/5/15 min) at start {load_start}, end {meta['load_average_1_5_15']['end']}.")
    cols = ["dtype", "status", "ttft_ms", "ttft_ms_median", "decode_tok_s", "decode_tok_s_median", "runs",
            "decode_tok_s_cv", "peak_mib", "load_peak_mib", "after_load_mib", "generate_peak_mib"]
    cols += ["reserved_peak_mib"] if on_cuda else []
    cols += ["weights_mib", "kv_pool_mib", "decode/f32", "ttft/f32", "peak_mem/f32", "same_tokens_as_f32"]
    _, md = write_results(f"activation-dtype-{model_label(model)}-{str(dev).replace(':', '')}", meta, rows, cols, note)
    print(md.read_text(), flush=True)
    return rows


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    print(json.dumps(measure_case(json.loads(sys.argv[2]))), flush=True)
