"""Offline throughput: many random-token requests submitted at once to one engine.

The usual small-engine workload (nano-vllm's bench.py): `num_seqs` requests (default 256),
each with a prompt of random token ids whose length is uniform in `input_len_range` and an
output length uniform in `output_len_range` (both default [100, 1024]), greedy, EOS
ignored, so every request produces exactly its output length. The ids are drawn (seeded)
from the model's vocabulary without its special (control/unknown) tokens.

All requests go to `LLM.generate` at once; the engine admits and schedules them with its
own defaults (max_active_requests, max_batched_tokens, KV budget) unless overridden.
Every timed run uses a fresh engine over the same loaded weights (`LLM.fork`: new KV
pool, new prefix cache, so no run reuses another's pages); one shorter warm-up run on
its own fresh engine comes first and is not counted.

Reported per run: total output tokens, wall time, output tok/s, total (prompt + output)
tok/s and requests/s; then mean ± sample std over the runs. When the coefficient of
variation of output tok/s exceeds `cv_target` (5%), more runs follow, up to `max_runs`.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from minivllm.bench.common import loadavg, model_label, provenance, summarize
from minivllm.bench.results import write_results
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.models.cache import sha256_file
from minivllm.sampling.sampling_params import SamplingParams

DEFAULT_LEN_RANGE = (100, 1024)
QUICK = {"num_seqs": 16, "input_len_range": (32, 128), "output_len_range": (32, 128), "runs": 1, "max_runs": 1}
WARMUP_MAX_TOKENS = 16
METRICS = ("output_tok_s", "total_tok_s", "requests_s", "wall_s")


def allowed_token_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """Ids a random prompt may use: the model's vocabulary minus special tokens and BOS/EOS."""
    banned = {tokenizer.bos_id, tokenizer.eos_id, *(tokenizer.eos_ids or ())}
    n = min(vocab_size, tokenizer.vocab_size)
    ids = np.array([i for i in range(n) if i not in banned and not tokenizer.is_special(i)], dtype=np.int64)
    if ids.size == 0:
        raise ConfigError("model", "<vocabulary>", "has no non-special tokens to build random prompts from")
    return ids


def make_workload(allowed: np.ndarray, num_seqs: int, input_len_range: tuple[int, int],
                  output_len_range: tuple[int, int], seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts as token-id lists, output lengths), the same for the same arguments."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len_range[0], input_len_range[1], size=num_seqs, endpoint=True)
    out_lens = rng.integers(output_len_range[0], output_len_range[1], size=num_seqs, endpoint=True)
    prompts = [[int(x) for x in rng.choice(allowed, size=int(n))] for n in in_lens]
    return prompts, [int(x) for x in out_lens]


def _check_range(name: str, r: tuple[int, int]) -> tuple[int, int]:
    lo, hi = int(r[0]), int(r[1])
    if not 1 <= lo <= hi:
        raise ConfigError(name, f"{lo}:{hi}", "expected 1 <= A <= B")
    return lo, hi


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(llm: LLM, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """One timed run on a fresh engine over `llm`'s weights; raises when any request's output
    length differs from the one it asked for."""
    engine_llm = llm.fork()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    dev = llm.model.device
    _sync(dev)
    t0 = time.perf_counter()
    outs = engine_llm.generate(prompts, params)
    _sync(dev)
    wall = time.perf_counter() - t0
    failures = [f"request {i}: {len(o.token_ids)} tokens ({o.finish_reason!r}), expected {n}"
                for i, (o, n) in enumerate(zip(outs, out_lens))
                if len(o.token_ids) != n or o.finish_reason != "length"]
    snap = engine_llm.snapshot()
    del engine_llm
    gc.collect()
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(outs)} requests did not produce exactly their output length: "
                           + "; ".join(failures[:10]))
    out_tokens = sum(len(o.token_ids) for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"requests": len(outs), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
            "wall_s": wall, "output_tok_s": out_tokens / wall, "total_tok_s": (prompt_tokens + out_tokens) / wall,
            "requests_s": len(outs) / wall,
            "preemptions": (snap.get("counters") or {}).get("preemptions"),
            "steps": (snap.get("counters") or {}).get("steps"),
            "output_lens": [len(o.token_ids) for o in outs], "engine_counters": snap.get("counters"),
            "kernels": snap.get("kernels"), "engine": snap.get("engine")}


def cv(samples: list[float]) -> float:
    """Coefficient of variation (sample std / mean); 0 for a single sample."""
    if len(samples) < 2:
        return 0.0
    return statistics.stdev(samples) / statistics.fmean(samples)


def run(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "f32", *, num_seqs: int = 256,
        input_len_range: tuple[int, int] = DEFAULT_LEN_RANGE, output_len_range: tuple[int, int] = DEFAULT_LEN_RANGE,
        seed: int = 0, runs: int = 3, max_runs: int = 8, cv_target: float = 0.05, quick: bool = False,
        threads: int | None = None, engine_options: dict | None = None, warmup: bool = True,
        max_seconds: float | None = None) -> dict:
    """Run the workload; write benchmarks/results/offline-<model>-<stamp>.{json,md}, rewritten after
    every run (so a stopped benchmark leaves the runs it finished). `max_seconds`: no further run
    starts once another run of the last one's length would end past this many seconds of timed
    runs (at least one run always happens). Returns {"runs": [per-run dicts], "summary": {...},
    "files": [json, md]}."""
    if quick:
        num_seqs, input_len_range, output_len_range = (
            QUICK["num_seqs"],
            QUICK["input_len_range"],
            QUICK["output_len_range"],
        )
        runs, max_runs = QUICK["runs"], QUICK["max_runs"]
    input_len_range = _check_range("input_len_range", input_len_range)
    output_len_range = _check_range("output_len_range", output_len_range)
    if num_seqs < 1:
        raise ConfigError("num_seqs", num_seqs, "must be >= 1")
    if runs < 1:
        raise ConfigError("runs", runs, "must be >= 1")
    max_runs = max(max_runs, runs)
    if threads is not None:
        torch.set_num_threads(threads)
    load_start = loadavg()
    engine_options = dict(engine_options or {})
    max_len = max(engine_options.pop("max_model_len", 0) or 0, input_len_range[1] + output_len_range[1])
    llm = LLM(model, device=device, dtype=dtype, progress=False, max_model_len=max_len, **engine_options)
    llm.engine = None  # each run forks its own engine; free this one's KV pool
    gc.collect()
    allowed = allowed_token_ids(llm.tokenizer, llm.config.vocab_size)
    prompts, out_lens = make_workload(allowed, num_seqs, input_len_range, output_len_range, seed)
    print(f"offline: {num_seqs} requests, {sum(map(len, prompts))} prompt tokens, {sum(out_lens)} output tokens "
          f"(seed {seed}); max_model_len {max_len}", flush=True)

    warm_desc = None
    if warmup:  # every prompt shape is prefilled once, decode at the admitted batch size
        n_warm = min(num_seqs, engine_options.get("max_active_requests", EngineConfig().max_active_requests))
        warm_lens = [min(n, WARMUP_MAX_TOKENS) for n in out_lens[:n_warm]]
        w = run_once(llm, prompts[:n_warm], warm_lens)
        warm_desc = (f"the first {n_warm} requests with at most {WARMUP_MAX_TOKENS} output tokens each, on a fresh "
                     f"engine ({w['wall_s']:.3g} s); not counted")
        print(f"warm-up: {warm_desc}", flush=True)

    results: list[dict] = []
    paths: tuple = ()
    kernels = engine_desc = None
    timed_s = 0.0
    stopped_early = None

    def _write(paths: tuple, stopped_early):
        out_cv = cv([r["output_tok_s"] for r in results])
        summary: dict = {"run": f"mean ± std (n={len(results)})", "requests": num_seqs,
                         "prompt_tokens": results[0]["prompt_tokens"], "output_tokens": results[0]["output_tokens"],
                         "output_tok_s_cv": out_cv, "cv_target_met": out_cv <= cv_target}
        for key in METRICS:
            s = summarize([r[key] for r in results])
            summary[f"{key}_mean"], summary[f"{key}_std"], summary[f"{key}_median"] = s["mean"], s["std"], s["median"]
            summary[key] = f"{s['mean']:.4g} ± {s['std']:.2g}"
        rows = [dict(r) for r in results] + [summary]
        settings = {"model": model, "device": str(llm.model.device), "dtype": dtype, "num_seqs": num_seqs,
                    "input_len_range": list(input_len_range), "output_len_range": list(output_len_range), "seed": seed,
                    "runs": runs, "max_runs": max_runs, "runs_done": len(results), "cv_target": cv_target,
                    "max_seconds": max_seconds, "stopped_early": stopped_early,
                    "quick": quick, "max_model_len": max_len, "engine_options": engine_options,
                    "engine_defaults_used": sorted({"max_active_requests", "max_batched_tokens", "kv_memory_bytes",
                                                    "kv_memory_fraction", "page_size", "kv_mode", "policy"}
                                                   - set(engine_options)),
                    "sampling": "greedy, ignore_eos (every request produces exactly its output length; checked)",
                    "prompt_source": "random token ids (numpy default_rng(seed)), special tokens and BOS/EOS excluded",
                    "allowed_token_ids": int(allowed.size), "output_lens": out_lens,
                    "prompt_lens": [len(p) for p in prompts], "warmup": warm_desc, "fresh_engine_per_run": True,
                    "torch_threads": torch.get_num_threads(), "kernels": kernels,
                    "engine": engine_desc}
        meta = provenance(str(llm.model.device), sha256_file(llm.model_path), settings)
        meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
        meta["summary"] = {k: v for k, v in summary.items() if not isinstance(v, str) or k == "run"}
        note = (
            f"Offline throughput: {num_seqs} requests submitted at once to one engine (LLM.generate), random-token "
            f"prompts of {input_len_range[0]}..{input_len_range[1]} tokens, outputs of exactly "
            f"{output_len_range[0]}..{output_len_range[1]} tokens (uniform, seed {seed}; greedy, EOS ignored). "
            f"Output tok/s = output tokens / wall time; total tok/s counts prompt tokens too. Fresh engine per run, "
            f"one warm-up not counted; last row: mean ± sample std over {len(results)} runs, CV of output tok/s "
            f"{out_cv:.1%} (target {cv_target:.0%}). Engine: "
            + (
                f"max_active_requests={engine_desc.get('max_active_requests')}, max_batched_tokens="
                f"{engine_desc.get('max_batched_tokens')}, {engine_desc.get('kv_mode')} KV with "
                f"{engine_desc.get('page_size')}-token pages, "
                if isinstance(engine_desc, dict)
                else ""
            )
            + f"max_model_len={max_len}; 'preemptions' counts requests preempted under KV pressure (their "
            f"tokens recomputed). "
            + (f"NOTE: {stopped_early}. " if stopped_early else "")
            + f"Device {meta['device']}; load average (1/5/15 min) at start {load_start}, end "
            f"{meta['load_average_1_5_15']['end']}."
        )
        cols = [
            "run",
            "requests",
            "prompt_tokens",
            "output_tokens",
            "wall_s",
            "output_tok_s",
            "total_tok_s",
            "requests_s",
            "steps",
            "preemptions",
        ]
        for old in paths:  # the previous run's files: one pair per benchmark
            Path(old).unlink(missing_ok=True)
        return write_results(f"offline-{model_label(model)}", meta, rows, cols, note), summary

    while len(results) < runs or (len(results) < max_runs and cv([r["output_tok_s"] for r in results]) > cv_target):
        if results and max_seconds is not None and timed_s + results[-1]["wall_s"] > max_seconds:
            stopped_early = (f"stopped after {len(results)} runs: another would pass max_seconds={max_seconds:g} "
                             f"({timed_s:.0f} s of timed runs so far)")
            print(stopped_early, flush=True)
            break
        r = run_once(llm, prompts, out_lens)
        r["run"] = len(results) + 1
        kernels, engine_desc = r.pop("kernels", None), r.pop("engine", None)
        timed_s += r["wall_s"]
        results.append(r)
        print(f"run {r['run']}: {r['output_tokens']} output tokens in {r['wall_s']:.2f} s: {r['output_tok_s']:.1f} "
              f"output tok/s, {r['total_tok_s']:.1f} total tok/s, {r['requests_s']:.3f} req/s", flush=True)
        paths, summary = _write(paths, stopped_early)
    if stopped_early:
        paths, summary = _write(paths, stopped_early)
    print(paths[1].read_text(), flush=True)
    return {"runs": results, "summary": summary, "files": [str(p) for p in paths]}
