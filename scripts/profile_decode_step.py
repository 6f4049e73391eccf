"""Where a batch-1 decode step spends its time, on one GPU: kernels, host, idle gaps.

    python scripts/profile_decode_step.py OUT_DIR TOKENIZER_FIELDS [--synthetic NAME]...
        [--prompt-tokens 512] [--steps 16] [--eager]

For each synthetic file (default: the Qwen2.5 0.5B and 7B Q4_K_M layouts) and context
length, an engine with one slot runs a prompt, then `--steps` decode steps under
torch.profiler. From the Chrome trace it derives, per decode step:

- every GPU kernel: calls per step, µs per step, share of GPU busy time (graph replays
  included: CUPTI reports the kernels a replayed graph runs);
- GPU busy time (the union of kernel and copy intervals) and the step's wall period, so
  `idle = wall - busy` is the time the GPU waits on the host between and inside steps;
- host time per step: `engine.step()` wall time spent in Python before the forward's
  work is queued plus after it completes (the trace's CPU spans of the step).

Writes OUT_DIR/profile-<name>-<ctx>.json and one Markdown table per file. Used by
scripts/gpu_vs_llama_cpp.sh; eager mode (`--eager`) attributes each launch to its
Python call site (graphs hide that) and shows the launch-bound cost graphs remove.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.kernels import copy_bandwidth_gbs
from minivllm.bench.synthetic_model import ensure_synthetic_model
from minivllm.kernels.gemv_configs import GEMV_KERNEL_ENV
from minivllm.kernels.gpu_profile import gpu_profile
from minivllm.kernels.triton.paged_attention import default_launch
from minivllm.kernels.triton.pdl import EARLY_ENV, pdl_requested


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def short_kernel_name(name: str) -> str:
    """Group template instances: a Triton kernel keeps its name, a CUDA one its function."""
    name = re.sub(r"<.*>", "<...>", name)
    name = re.sub(r"\(.*\)", "", name)
    return name[:90]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def analyse(trace_path: Path, steps: int) -> dict:
    events = json.loads(trace_path.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    by_kernel: dict[str, list[float]] = defaultdict(list)
    for e in gpu:
        by_kernel[short_kernel_name(e["name"])].append(float(e["dur"]))
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu]
    busy = union_length(intervals)
    window = max(e for _, e in intervals) - min(s for s, _ in intervals)
    ordered = sorted(intervals)
    gaps, end = [], ordered[0][1]
    for s, e in ordered[1:]:
        if s > end:
            gaps.append(s - end)
        end = max(end, e)
    step_spans = sorted(float(e["dur"]) for e in events
                        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name") == "decode_step")
    kernels = sorted(({"kernel": k, "calls_per_step": len(v) / steps, "us_per_step": sum(v) / steps,
                       "share": sum(v) / max(busy, 1e-9), "us_per_call": statistics.fmean(v)}
                      for k, v in by_kernel.items()), key=lambda r: -r["us_per_step"])
    return {
        "steps": steps,
        "gpu_events_per_step": len(gpu) / steps,
        "gpu_busy_us_per_step": busy / steps,
        "gpu_window_us_per_step": window / steps,
        "gpu_idle_us_per_step": (window - busy) / steps,
        "gaps_over_5us_per_step": sum(1 for g in gaps if g > 5) / steps,
        "largest_gaps_us": sorted(gaps, reverse=True)[:8],
        "step_wall_us": {"median": statistics.median(step_spans) if step_spans else None,
                         "mean": statistics.fmean(step_spans) if step_spans else None},
        "kernels": kernels,
    }


def profile_one(name: str, fields: str, prompt_tokens: int, steps: int, eager: bool, out: Path,
                device: str = "cuda:0", rows: int = 1, prefill: bool = False) -> dict:
    path = ensure_synthetic_model(name, tokenizer_source=fields, progress=False)
    dtype = "f16" if device.startswith("cuda") else "f32"
    llm = LLM(str(path), device=device, dtype=dtype, progress=False, max_model_len=prompt_tokens + 256,
              max_batched_tokens=max(512, prompt_tokens), max_active_requests=rows, prefix_cache=False,
              enforce_eager=eager)
    ids = [1000 + (i * 7919) % 20000 for i in range(prompt_tokens)]
    llm.generate([ids[:64]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # compile, capture
    engine = llm.engine
    if prefill:
        return profile_prefills(llm, name, ids, steps, device, out)
    for r in range(rows):  # distinct prompts (no shared prefix), decoding side by side
        engine.add_request([(t + 131 * r) % 30000 + 1000 for t in ids],
                           SamplingParams(temperature=0.0, max_tokens=steps * 3 + 16, ignore_eos=True))
    while engine.has_unfinished() and engine.counters["steps"] < 8 + rows * -(-prompt_tokens // 512):
        engine.step()  # the prefill chunks, then a few decode steps (graph capture)
    sync(device)
    # Untraced timing first: the profiler itself slows the host.
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    untraced_us = (time.perf_counter() - t0) / steps * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.profiler.record_function("decode_step"):
                engine.step()
        sync(device)
    trace = out / f"trace-{name}-{prompt_tokens}-{rows}{'-eager' if eager else ''}.json"
    prof.export_chrome_trace(str(trace))
    result = analyse(trace, steps)
    result.update(model=name, context=prompt_tokens, rows=rows, eager=eager, untraced_step_us=untraced_us,
                  tok_per_s=1e6 / untraced_us, kernel_paths=llm.snapshot().get("kernels"))
    trace.unlink()  # tens of MB; the analysis is what comes back
    del llm, engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def profile_prefills(llm, name: str, ids: list[int], steps: int, device: str, out: Path) -> dict:
    """`steps` prefills of `ids` (each a fresh prompt, one step for the whole chunk):
    what the prompt's forward costs the GPU and the host."""
    engine = llm.engine

    def one_prefill(k: int) -> None:
        rid = engine.add_request([(t + 17 * k) % 30000 + 1000 for t in ids],
                                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        engine.pop_output(rid)

    one_prefill(-1)
    sync(device)
    t0 = time.perf_counter()
    for k in range(steps):
        one_prefill(k)
    sync(device)
    untraced_us = (time.perf_counter() - t0) / steps * 1e6
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in range(steps):
            with torch.profiler.record_function("decode_step"):
                one_prefill(steps + k)
        sync(device)
    trace = out / f"trace-{name}-{len(ids)}-prefill.json"
    prof.export_chrome_trace(str(trace))
    result = analyse(trace, steps)
    result.update(model=name, context=len(ids), rows=1, eager=True, prefill=True, untraced_step_us=untraced_us,
                  tok_per_s=len(ids) * 1e6 / untraced_us, kernel_paths=llm.snapshot().get("kernels"))
    trace.unlink()
    return result


# The step's GEMV work: the decode GEMVs, their split-K sums and (MINIVLLM_Q8_GEMV=1) the
# activations' quantization. (Deferred split sums run inside _add_rms_norm_kernel: not counted.)
def gemv_label(r: dict) -> str:
    """', MMA GEMV' / ', legacy GEMV' where the run took another decode GEMV than the tiled one."""
    kernel = r.get("gemv_kernel", "tiled")
    return "" if kernel == "tiled" else f", {'MMA' if kernel == 'mma' else kernel} GEMV"


GEMV_KERNELS = re.compile(r"gemv|sum_splits|quantize_q8")


def gemv_share(r: dict, copy_gbs: float | None) -> dict | None:
    """The GEMVs' bandwidth in the step: the bytes they read a step (every projection and
    the LM head once, at one row) over their kernels' time a step, and its share of a plain
    device copy's bandwidth (read + write, bench/kernels.copy_bandwidth_gbs)."""
    weight_bytes = (r.get("kernel_paths") or {}).get("gemv_weight_bytes")
    us = sum(k["us_per_step"] for k in r.get("kernels", []) if GEMV_KERNELS.search(k["kernel"]))
    if not weight_bytes or not us or r.get("rows") != 1 or r.get("prefill"):
        return None
    gbs = weight_bytes / us / 1e3
    return {"gemv_us_per_step": us, "gemv_weight_bytes": weight_bytes, "gemv_gb_per_s": gbs,
            "copy_gb_per_s": copy_gbs, "gemv_frac_of_copy": None if not copy_gbs else gbs / copy_gbs}


def markdown(r: dict) -> str:
    lines = [
        f"### {r['model']}, context {r['context']}, {r['rows']} row(s), {'eager' if r['eager'] else 'CUDA graphs'}"
        f"{', PDL' if r.get('pdl') else ''}{', MMA attention' if r.get('mma') else ''}"
        f"{', GEMV early first trip' if r.get('early') else ''}{gemv_label(r)}"
        f"{', int8-activation GEMV (MINIVLLM_Q8_GEMV=1)' if r.get('int8_gemv') else ''}",
        "",
        f"- step: {r['untraced_step_us']:.0f} µs untraced ({r['tok_per_s']:.1f} tok/s); traced wall "
        f"median {r['step_wall_us']['median'] or 0:.0f} µs",
        f"- GPU busy {r['gpu_busy_us_per_step']:.0f} µs/step, idle {r['gpu_idle_us_per_step']:.0f} µs/step "
        f"({r['gaps_over_5us_per_step']:.1f} gaps > 5 µs per step; largest "
        f"{', '.join(f'{g:.0f}' for g in r['largest_gaps_us'][:4])} µs)",
        f"- {r['gpu_events_per_step']:.0f} GPU kernels and copies per step",
    ]
    g = r.get("gemv_share")
    if g:
        lines.append(f"- GEMV kernels {g['gemv_us_per_step']:.0f} µs/step over {g['gemv_weight_bytes'] / 1e9:.3f} GB "
                     f"of weights: {g['gemv_gb_per_s']:.0f} GB/s"
                     + (f", {g['gemv_frac_of_copy']:.1%} of a device copy ({g['copy_gb_per_s']:.0f} GB/s)"
                        if g["gemv_frac_of_copy"] else ""))
    lines += [
        "",
        "| kernel | calls/step | µs/step | share | µs/call |",
        "|---|---|---|---|---|",
    ]
    for k in r["kernels"][:18]:
        lines.append(f"| `{k['kernel']}` | {k['calls_per_step']:.1f} | {k['us_per_step']:.1f} | "
                     f"{100 * k['share']:.1f}% | {k['us_per_call']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("fields")
    ap.add_argument("--synthetic", action="append")
    ap.add_argument("--prompt-tokens", type=int, action="append")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--rows", type=int, default=1, help="requests decoding side by side")
    ap.add_argument("--prefill", action="store_true", help="profile whole prompts' prefills instead")
    ap.add_argument("--device", default="cuda:0", help="cuda:0; cpu only checks the script")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    names = a.synthetic or ["qwen2.5-0.5b-q4_k_m", "qwen2.5-7b-q4_k_m"]
    results, copy_gbs = [], None
    for name in names:
        for ctx in a.prompt_tokens or [512]:
            try:
                r = profile_one(name, a.fields, ctx, a.steps, a.eager, a.out, a.device, a.rows, a.prefill)
            except Exception as exc:  # noqa: BLE001 — one failed profile must not lose the others
                r = {"model": name, "context": ctx, "error": f"{type(exc).__name__}: {exc}"}
                print(r, file=sys.stderr)
            r["pdl"] = pdl_requested()  # programmatic dependent launch (sm_90+; off: MINIVLLM_PDL=0)
            r["mma"] = default_launch().mma  # the tensor-core attention body (off: MINIVLLM_ATTENTION_MMA=0)
            r["early"] = os.environ.get(EARLY_ENV) == "1"  # the GEMV's first trip loaded before the PDL wait
            r["gemv_kernel"] = os.environ.get(GEMV_KERNEL_ENV, "tiled")  # mma: the tensor-core Q4_K GEMV
            r["int8_gemv"] = gpu_profile(torch.device(a.device)).int8_gemv if a.device.startswith("cuda") else False
            if "error" not in r and copy_gbs is None and a.device.startswith("cuda"):
                copy_gbs = copy_bandwidth_gbs(torch.device(a.device))
            r["gemv_share"] = None if "error" in r else gemv_share(r, copy_gbs)
            results.append(r)
            tag = (f"{name}-{ctx}-{a.rows}{'-eager' if a.eager else ''}{'-prefill' if a.prefill else ''}"
                   f"{'' if r['pdl'] else '-nopdl'}{'' if r['mma'] else '-plainattn'}"
                   f"{'-early' if r['early'] else ''}"
                   f"{'' if r['gemv_kernel'] == 'tiled' else '-' + r['gemv_kernel'] + 'gemv'}"
                   f"{'-int8gemv' if r['int8_gemv'] else ''}")
            (a.out / f"profile-{tag}.json").write_text(json.dumps(r, indent=1))
            if "error" not in r:
                md = markdown(r)
                (a.out / f"profile-{tag}.md").write_text(md)
                print(md, flush=True)


if __name__ == "__main__":
    main()
