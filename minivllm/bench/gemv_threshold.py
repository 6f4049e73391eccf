"""Where GEMV stops beating GEMM: the original's "Two rows, a different kernel" table.

For N = 1..8 concurrent requests (distinct prompts from data/prompts.json, greedy, EOS
ignored, exactly `max_tokens` outputs each), aggregate output tok/s = N * max_tokens / wall:

* sequential — the N requests one after another (decode: one row per step), under the
  device's default kernel options;
* batched GEMM — all N submitted together with `gemv_max_rows=0`: every matmul dequantizes
  (or reads the dequant cache) and runs one GEMM;
* batched row-wise GEMV — all N together with `gemv_max_rows = max(concurrency)`, so every
  decode step (N <= max rows) takes the fused dequantize-GEMV kernel; prefill steps with
  more rows than that still use GEMM in both batched modes;
* optionally batched with `batch_invariant=True` (every row through the same per-row
  kernel), so the price of batch invariance is stated next to the other two.

One model, one `LLMEngine` per mode (an engine applies its own kernel options to the model
before every forward); the modes take turns inside every repeat, so each GEMV/GEMM ratio
compares runs made next to each other. Per N at least `repeats` rounds (every mode once
each), then whole rounds continue while any mode's tok/s varies by more than 5%
(coefficient of variation), up to `max_repeats` rounds (`common.runs_until_stable`); each
row records its `runs` and every mode's CV (`<mode>_tok_s_cv`). Each row also records how
many matmul calls took each path (the engine's per-step `kernel_paths`), the evidence that
a mode ran the kernel it is named after.

Recommended default `gemv_max_rows`: the largest N whose median GEMV/GEMM ratio is >= 1
(0 when GEMM wins already at N=1).
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from minivllm.bench.common import (
    CV_TARGET,
    default_max_repeats,
    loadavg,
    model_label,
    provenance,
    record_rounds,
    runs_note,
    runs_until_stable,
    summarize,
)
from minivllm.bench.continuous_batching import load_prompts
from minivllm.bench.results import write_results
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.models.cache import sha256_file
from minivllm.sampling.sampling_params import SamplingParams

DEFAULT_CONCURRENCY = list(range(1, 9))


def record_stat(row: dict, key: str, samples: list[float]) -> None:
    s = summarize(samples)
    row[f"{key}_mean"], row[f"{key}_std"], row[f"{key}_median"] = s["mean"], s["std"], s["median"]
    row[key] = f"{s['mean']:.4g} ± {s['std']:.2g}"  # the Markdown column


def recommend(rows: list[dict]) -> int:
    """The largest concurrency whose median GEMV/GEMM ratio is >= 1, else 0 (GEMV disabled)."""
    wins = [r["concurrency"] for r in rows if r["gemv/gemm_median"] >= 1.0]
    return max(wins, default=0)


def _drain(engine: LLMEngine, rids: list[str], max_tokens: int, paths: Counter) -> None:
    while engine.has_unfinished():
        engine.step()
        paths.update(engine.last_step["kernel_paths"])  # matmul calls per path in that step
    for rid in rids:  # every run must produce exactly the tokens it is credited with
        out = engine.pop_output(rid)
        if out.finish_reason != "length" or len(out.token_ids) != max_tokens:
            raise RuntimeError(f"request {rid} finished with {out.finish_reason!r} after {len(out.token_ids)} "
                               f"tokens, expected 'length' after {max_tokens}")


def _sync(engine: LLMEngine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def _run_batched(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[float, Counter]:
    paths: Counter = Counter()
    t0 = time.perf_counter()
    rids = [engine.add_request(ids, params) for ids in prompt_ids]
    _drain(engine, rids, params.max_tokens, paths)
    _sync(engine)
    return time.perf_counter() - t0, paths


def _run_sequential(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[float, Counter]:
    paths: Counter = Counter()
    t0 = time.perf_counter()
    for ids in prompt_ids:
        _drain(engine, [engine.add_request(ids, params)], params.max_tokens, paths)
    _sync(engine)
    return time.perf_counter() - t0, paths


def run(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "f32", *,
        concurrency: list[int] | None = None, max_tokens: int = 32, repeats: int = 3, max_repeats: int | None = None,
        batch_invariant: bool = False, prompts: list[str] | None = None, max_batched_tokens: int = 512,
        page_size: int = 16) -> list[dict]:
    """One row per N in `concurrency`. Per N at least `repeats` rounds of every mode, more while a mode's
    tok/s CV exceeds 5%, at most `max_repeats` (default 3 x repeats)."""
    concurrency = concurrency or DEFAULT_CONCURRENCY
    if repeats < 1:
        raise ConfigError("repeats", repeats, "must be >= 1")
    max_repeats = default_max_repeats(repeats, max_repeats)
    if max_tokens < 1:
        raise ConfigError("max_tokens", max_tokens, "must be >= 1")
    if min(concurrency) < 1:
        raise ConfigError("concurrency", min(concurrency), "every N must be >= 1")
    load_start = loadavg()
    n_max = max(concurrency)
    llm = LLM(model, device=device, dtype=dtype, progress=False, max_model_len=64)  # the engine is made below
    tok, dev = llm.tokenizer, llm.model.device
    texts = prompts or load_prompts(n_max)
    prompt_ids = [tok.encode(t) for t in texts]
    base = dict(kv_mode="paged", page_size=page_size, max_batched_tokens=max_batched_tokens,
                max_active_requests=n_max, max_model_len=max(map(len, prompt_ids)) + max_tokens + 1)
    # One engine per mode over the one model: an engine passes its own kernel options
    # with every forward (see LLMEngine.kernel_options).
    configs: dict[str, tuple[dict, bool]] = {  # name -> (kernel options, batched)
        "sequential": ({}, False),  # the device default
        "gemm": ({"gemv_max_rows": 0}, True),
        "gemv": ({"gemv_max_rows": n_max}, True),
    }
    if batch_invariant:
        configs["batch_invariant"] = ({"batch_invariant": True}, True)
    engines = {m: (LLMEngine(llm.model, tok, EngineConfig(**base, **opts)), batched)
               for m, (opts, batched) in configs.items()}

    def timed(mode: str, ids: list[list[int]], params: SamplingParams) -> tuple[float, Counter]:
        engine, batched = engines[mode]
        return (_run_batched if batched else _run_sequential)(engine, ids, params)

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=min(max_tokens, 8), ignore_eos=True)
    for mode in engines:  # warm-up: every mode's kernels at the largest batch (and one row)
        timed(mode, prompt_ids[:n_max], warm)
    rows, all_rounds = [], []
    for n in concurrency:
        ids = prompt_ids[:n]
        total = n * max_tokens

        def one_round(ids=ids) -> dict[str, tuple[float, Counter]]:  # every mode once, one after another
            return {mode: timed(mode, ids, params) for mode in engines}

        rounds = runs_until_stable(one_round, min_runs=repeats, max_runs=max_repeats, cv_target=CV_TARGET,
                                   key=lambda m, total=total: [total / m[mode][0] for mode in engines])
        all_rounds.append(rounds)
        tps = {mode: [total / m[mode][0] for m in rounds.samples] for mode in engines}
        paths = {mode: dict(rounds.samples[-1][mode][1]) for mode in engines}  # per run; the same in every run
        ratio = [g / m for g, m in zip(tps["gemv"], tps["gemm"])]
        bi_cost = ([b / max(g, m) for b, g, m in zip(tps["batch_invariant"], tps["gemv"], tps["gemm"])]
                   if batch_invariant else [])
        row = {"concurrency": n, "output_tokens_per_request": max_tokens, "prompt_tokens": [len(x) for x in ids]}
        record_stat(row, "sequential_tok_s", tps["sequential"])
        record_stat(row, "gemm_tok_s", tps["gemm"])
        record_stat(row, "gemv_tok_s", tps["gemv"])
        record_stat(row, "gemv/gemm", ratio)
        if batch_invariant:
            record_stat(row, "batch_invariant_tok_s", tps["batch_invariant"])
            record_stat(row, "invariant/best", bi_cost)
        record_rounds(row, rounds, [f"{mode}_tok_s" for mode in engines])
        row["matmul_paths_per_run"] = paths
        row["samples"] = tps
        rows.append(row)
        print(f"N={n}: sequential {row['sequential_tok_s']}, GEMM {row['gemm_tok_s']}, GEMV {row['gemv_tok_s']} "
              f"tok/s; GEMV/GEMM {row['gemv/gemm']} ({rounds.runs} runs, {rounds.stopped})", flush=True)

    best = recommend(rows)
    settings = {"model": model, "inference_device": device, "activation_dtype": dtype, "concurrency": concurrency,
                "max_tokens": max_tokens, "repeats": repeats, "max_repeats": max_repeats, "cv_target": CV_TARGET,
                "rounds": [{"concurrency": n, **r.info()} for n, r in zip(concurrency, all_rounds)],
                "batch_invariant_row": batch_invariant,
                "max_batched_tokens": max_batched_tokens, "page_size": page_size, "kv_mode": "paged",
                "policy": "fcfs", "sampling": "greedy, ignore_eos", "torch_threads": torch.get_num_threads(),
                "modes": {m: {**e.kernel_options.describe(), "batched": b} for m, (e, b) in engines.items()},
                "prompts": texts[:n_max],
                "warmup": f"every mode once at N={n_max}, {warm.max_tokens} tokens"}
    meta = provenance(str(dev) if dev.type == "cuda" else device, sha256_file(llm.model_path), settings)
    meta["recommended_gemv_max_rows"] = best
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    over_runs = runs_note(all_rounds, repeats, max_repeats, "mode's tok/s")
    note = (f"Aggregate output tok/s = N x {max_tokens} tokens / wall time, {over_runs} "
            f"after a warm-up (medians in the JSON); modes take turns within each run, ratios are per run. "
            f"sequential: one request at a time, default options (gemv_max_rows="
            f"{engines['sequential'][0].kernel_options.gemv_max_rows}); GEMM: "
            f"batched, gemv_max_rows=0; GEMV: batched, gemv_max_rows={n_max} (every decode step row-wise GEMV)"
            + ("; invariant: batched, batch_invariant=True, its tok/s over the faster of GEMM/GEMV" if batch_invariant
               else "") + f". Recommended default gemv_max_rows (largest N with median GEMV/GEMM >= 1): {best}. "
            f"Load average (1/5/15 min) at start {load_start}, end {meta['load_average_1_5_15']['end']}.")
    cols = ["concurrency", "sequential_tok_s", "gemm_tok_s", "gemv_tok_s", "gemv/gemm", "gemv/gemm_median"]
    if batch_invariant:
        cols += ["batch_invariant_tok_s", "invariant/best"]
    cols += ["runs", "cv"]
    _, md = write_results(f"gemv-threshold-{model_label(model)}", meta, rows, cols, note)
    print(md.read_text(), flush=True)
    return rows
