"""Continuous batching: aggregate throughput batched vs sequential, and paged vs contiguous decode.

Repeats the original's continuous-batching experiments (reference §4.7 and the article
"Why Continuous Batching Made My LLM Inference Engine Slower"):

(a) N concurrent requests (distinct prompts from data/prompts.json, greedy, `ignore_eos`,
    exactly `max_tokens` outputs each) either all submitted together to one `LLMEngine`
    and stepped until done ("batched"), or run one after another through the same engine
    ("sequential"). Aggregate output tok/s = N * max_tokens / wall time. The two modes
    alternate inside every repeat, so each batched/sequential ratio compares numbers
    measured next to each other. Issue target: N=4 >= 2x on CPU (>= 3x on GPU).

(b) One request decoding L tokens through a paged KV cache (page_size pages gathered per
    step) and through a contiguous one (a single page holding the whole sequence);
    decode tok/s from RequestMetrics.decode_tokens_per_s. Target: paged >= 0.95x contiguous.

One `LLM` loads the model and tokenizer; each configuration gets its own `LLMEngine`.

Runs: per row (a concurrency in (a), a decode length in (b)) at least `repeats` rounds, each
measuring every mode once; then whole rounds continue while either mode's tok/s varies by more
than 5% (coefficient of variation), up to `max_repeats` rounds (`common.runs_until_stable`).
Each row records its `runs` and every watched CV; the settings record the rounds of each row.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from minivllm.bench.common import (
    CV_TARGET,
    default_max_repeats,
    loadavg,
    model_label,
    provenance,
    record_rounds,
    record_stat,
    runs_note,
    runs_until_stable,
)
from minivllm.bench.results import write_results
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.models.cache import sha256_file
from minivllm.sampling.sampling_params import SamplingParams

PROMPTS_FILE = Path(__file__).resolve().parents[2] / "data" / "prompts.json"
FULL_DECODE_LENGTHS = [512, 2048]
QUICK_DECODE_LENGTHS = [128, 512]
PARTS = ("batching", "kv")
DECODE_PROMPT = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
                 "combined movable metal type, oil-based ink and a wine press into a machine that")


def load_prompts(n: int) -> list[str]:
    """n distinct prompts from data/prompts.json (numbered variants once the file runs out)."""
    base = json.loads(PROMPTS_FILE.read_text())["prompts"]
    return [base[i % len(base)] if i < len(base) else f"Variant {i // len(base)}. {base[i % len(base)]}"
            for i in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(engine: LLMEngine, rids: list[str], max_tokens: int) -> list:
    while engine.has_unfinished():
        engine.step()
    _sync(engine.model.device)
    outs = [engine.pop_output(r) for r in rids]
    for o in outs:  # every run must produce exactly the tokens it is credited with
        if o.finish_reason != "length" or len(o.token_ids) != max_tokens:
            raise RuntimeError(f"request {o.request_id} finished with {o.finish_reason!r} after "
                               f"{len(o.token_ids)} tokens, expected 'length' after {max_tokens}")
    return outs


def run_batched(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    t0 = time.perf_counter()
    rids = [engine.add_request(ids, params) for ids in prompt_ids]
    outs = _drain(engine, rids, params.max_tokens)
    return time.perf_counter() - t0, outs


def run_sequential(engine: LLMEngine, prompt_ids: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    outs = []
    t0 = time.perf_counter()
    for ids in prompt_ids:
        outs += _drain(engine, [engine.add_request(ids, params)], params.max_tokens)
    return time.perf_counter() - t0, outs


def run(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "f32", *,
        concurrency: list[int] | None = None, max_tokens: int = 64, decode_lengths: list[int] | None = None,
        quick: bool = False, repeats: int = 3, max_repeats: int | None = None, max_batched_tokens: int = 512,
        page_size: int = 16, prompts: list[str] | None = None, parts: list[str] | None = None) -> dict[str, list[dict]]:
    """Run the experiments in `parts` ("batching", "kv"; default both); each writes its result files as
    soon as it finishes. Returns {"batching": rows, "kv": rows}. `prompts` overrides data/prompts.json.
    Per row at least `repeats` rounds, more while a mode's tok/s CV exceeds 5%, at most `max_repeats`
    (default 3 x repeats)."""
    concurrency = concurrency or [1, 2, 3, 4, 5, 8]
    parts = parts or list(PARTS)
    for p in parts:
        if p not in PARTS:
            raise ConfigError("parts", p, f"allowed: {', '.join(PARTS)}")
    if repeats < 1:
        raise ConfigError("repeats", repeats, "must be >= 1")
    max_repeats = default_max_repeats(repeats, max_repeats)
    llm = LLM(model, device=device, dtype=dtype, progress=False, max_model_len=64)  # engines are made below
    dev = llm.model.device
    if decode_lengths is None:
        # The full sizes take ~40 min of decoding on a 2-core CPU; there the quick sizes are the default.
        quick = quick or dev.type == "cpu"
        decode_lengths = QUICK_DECODE_LENGTHS if quick else FULL_DECODE_LENGTHS
    elif quick:
        decode_lengths = QUICK_DECODE_LENGTHS
    sha = sha256_file(llm.model_path)
    texts = prompts or load_prompts(max(concurrency))
    settings = {"model": model, "inference_device": device, "activation_dtype": dtype, "repeats": repeats,
                "max_repeats": max_repeats, "cv_target": CV_TARGET, "warmup_runs": 1,
                "max_batched_tokens": max_batched_tokens, "page_size": page_size,
                "sampling": "greedy, ignore_eos", "torch_threads": torch.get_num_threads()}
    out: dict[str, list[dict]] = {}
    if "batching" in parts:
        out["batching"] = _batching(llm, sha, model, device, dict(settings), texts, concurrency, max_tokens,
                                    repeats, max_repeats, max_batched_tokens, page_size)
    if "kv" in parts:
        out["kv"] = _paged_vs_contiguous(llm, sha, model, device, dict(settings), decode_lengths, quick, repeats,
                                         max_repeats, max_batched_tokens, page_size)
    return out


def _meta(llm: LLM, device: str, sha: str, settings: dict, load_start) -> dict:
    dev = llm.model.device
    meta = provenance(device if dev.type != "cuda" else str(dev), sha, settings)
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg(),
                                   "note": "the benchmark's own threads add about torch_threads to the load"}
    return meta


def _batching(llm: LLM, sha: str, model: str, device: str, settings: dict, texts: list[str], concurrency: list[int],
              max_tokens: int, repeats: int, max_repeats: int, max_batched_tokens: int, page_size: int) -> list[dict]:
    """(a) aggregate output tok/s, N requests batched vs the same N one after another."""
    load_start = loadavg()
    tok = llm.tokenizer
    dev = llm.model.device
    prompt_ids = [tok.encode(t) for t in texts]
    n_max = max(concurrency)
    cfg = EngineConfig(kv_mode="paged", page_size=page_size, max_batched_tokens=max_batched_tokens,
                       max_active_requests=max(n_max, 1), max_model_len=max(map(len, prompt_ids)) + max_tokens + 1)
    engine = LLMEngine(llm.model, tok, cfg)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Warm-up: every batch shape once (a short run), then one request alone.
    warm = SamplingParams(temperature=0.0, max_tokens=min(max_tokens, 16), ignore_eos=True)
    run_batched(engine, prompt_ids[:n_max], warm)
    run_sequential(engine, prompt_ids[:1], warm)
    rows, all_rounds = [], []
    for n in concurrency:
        ids = prompt_ids[:n]
        total = n * max_tokens

        def one_round(ids=ids) -> tuple[float, float, float]:  # both modes once: (batched, sequential) wall, TTFT
            wb, outs = run_batched(engine, ids, params)
            ws, _ = run_sequential(engine, ids, params)
            return wb, ws, max(o.metrics.time_to_first_token_s for o in outs)

        rounds = runs_until_stable(one_round, min_runs=repeats, max_runs=max_repeats, cv_target=CV_TARGET,
                                   key=lambda m, total=total: [total / m[0], total / m[1]])
        all_rounds.append(rounds)
        b_tps = [total / wb for wb, _, _ in rounds.samples]
        s_tps = [total / ws for _, ws, _ in rounds.samples]
        ratios = [ws / wb for wb, ws, _ in rounds.samples]
        ttft_b = [t for _, _, t in rounds.samples]
        row = {"concurrency": n, "output_tokens_per_request": max_tokens, "prompt_tokens": [len(x) for x in ids]}
        record_stat(row, "batched_tok_s", b_tps)
        record_stat(row, "sequential_tok_s", s_tps)
        record_stat(row, "batched/sequential", ratios)
        record_stat(row, "batched_max_ttft_s", ttft_b)
        record_rounds(row, rounds, ["batched_tok_s", "sequential_tok_s"])
        row["samples"] = {"batched_tok_s": b_tps, "sequential_tok_s": s_tps, "ratio": ratios}
        rows.append(row)
        print(f"N={n}: batched {row['batched_tok_s']} tok/s, sequential {row['sequential_tok_s']} tok/s, "
              f"ratio {row['batched/sequential']} ({rounds.runs} runs, {rounds.stopped})", flush=True)
    target = 3.0 if dev.type == "cuda" else 2.0
    for row in rows:
        row[f"target_met(N=4,>={target:g}x)"] = (
            (row["batched/sequential_mean"] >= target) if row["concurrency"] == 4 else None
        )
    settings.update({"experiment": "batched vs sequential", "concurrency": concurrency, "max_tokens": max_tokens,
                     "warmup": f"batched N={n_max} and one sequential request, {warm.max_tokens} tokens each",
                     "kv_mode": "paged", "policy": "fcfs", "max_active_requests": cfg.max_active_requests,
                     "max_model_len": cfg.max_model_len, "prompts": texts[:n_max],
                     "rounds": [{"concurrency": n, **r.info()} for n, r in zip(concurrency, all_rounds)]})
    meta = _meta(llm, device, sha, settings, load_start)
    note = (f"Aggregate output tok/s = N x {max_tokens} tokens / wall time; "
            f"{runs_note(all_rounds, repeats, max_repeats, 'batched or sequential tok/s')} after a warm-up. "
            f"'batched': all N submitted together to one LLMEngine (paged, fcfs, "
            f"max_batched_tokens={max_batched_tokens}); 'sequential': the same N requests one after another through "
            f"the same engine. The two alternate within each run; the ratio is per run. Target: N=4 >= {target:g}x "
            f"on {dev.type.upper()}. Load average (1/5/15 min) at start {load_start}, end "
            f"{meta['load_average_1_5_15']['end']} (the benchmark itself adds ~{torch.get_num_threads()}).")
    cols = ["concurrency", "batched_tok_s", "sequential_tok_s", "batched/sequential", "batched/sequential_median",
            "batched_max_ttft_s", "runs", "cv", f"target_met(N=4,>={target:g}x)"]
    _, md = write_results(f"continuous-batching-{model_label(model)}", meta, rows, cols, note)
    print(md.read_text(), flush=True)
    return rows


def _paged_vs_contiguous(llm: LLM, sha: str, model: str, device: str, settings: dict, decode_lengths: list[int],
                         quick: bool, repeats: int, max_repeats: int, max_batched_tokens: int,
                         page_size: int) -> list[dict]:
    """(b) one request's decode tok/s through a paged and a contiguous KV cache."""
    load_start = loadavg()
    tok = llm.tokenizer
    dec_ids = tok.encode(DECODE_PROMPT)
    max_len = max(decode_lengths) + len(dec_ids) + 1
    engines = {
        mode: LLMEngine(
            llm.model,
            tok,
            EngineConfig(
                kv_mode=mode,
                page_size=page_size,
                max_model_len=max_len,
                max_active_requests=1,
                max_batched_tokens=max_batched_tokens,
            ),
        )
        for mode in ("paged", "contiguous")
    }
    warm = SamplingParams(temperature=0.0, max_tokens=min(32, max(decode_lengths)), ignore_eos=True)
    for e in engines.values():
        run_batched(e, [dec_ids], warm)
    rows, all_rounds = [], []
    for length in decode_lengths:
        p = SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True)

        def one_round(p=p) -> dict[str, float]:  # paged, then contiguous: decode tok/s of each
            return {mode: run_batched(e, [dec_ids], p)[1][0].metrics.decode_tokens_per_s
                    for mode, e in engines.items()}

        rounds = runs_until_stable(one_round, min_runs=repeats, max_runs=max_repeats, cv_target=CV_TARGET,
                                   key=lambda m: [m[mode] for mode in engines])
        all_rounds.append(rounds)
        tps = {mode: [m[mode] for m in rounds.samples] for mode in engines}
        ratios = [m["paged"] / m["contiguous"] for m in rounds.samples]
        row = {"decode_tokens": length, "prompt_tokens": len(dec_ids), "max_model_len": max_len, "page_size": page_size}
        record_stat(row, "paged_decode_tok_s", tps["paged"])
        record_stat(row, "contiguous_decode_tok_s", tps["contiguous"])
        record_stat(row, "paged/contiguous", ratios)
        row["target_met(>=0.95)"] = row["paged/contiguous_mean"] >= 0.95
        record_rounds(row, rounds, [f"{mode}_decode_tok_s" for mode in engines])
        row["samples"] = {**tps, "ratio": ratios}
        rows.append(row)
        print(f"L={length}: paged {row['paged_decode_tok_s']}, contiguous {row['contiguous_decode_tok_s']}, "
              f"ratio {row['paged/contiguous']} ({rounds.runs} runs, {rounds.stopped})", flush=True)
    settings.update({"experiment": "paged vs contiguous decode", "decode_lengths": decode_lengths, "quick": quick,
                     "max_model_len": max_len, "max_active_requests": 1, "decode_prompt": DECODE_PROMPT,
                     "warmup": f"one {warm.max_tokens}-token request per engine",
                     "rounds": [{"decode_tokens": n, **r.info()} for n, r in zip(decode_lengths, all_rounds)]})
    meta = _meta(llm, device, sha, settings, load_start)
    note = (
        f"One request, greedy, exactly L output tokens; decode tok/s = (L-1)/(e2e - TTFT) from RequestMetrics; "
        f"{runs_note(all_rounds, repeats, max_repeats, 'paged or contiguous decode tok/s')} after a warm-up, "
        f"paged and contiguous alternating; the ratio is per run. Paged: {page_size}-token pages; contiguous: "
        f"one page of max_model_len={max_len} tokens. Target "
        f"paged/contiguous >= 0.95."
        + (" QUICK sizes (128, 512 instead of 512, 2048) to fit a CPU run." if quick else "")
        + f" Load average (1/5/15 min) at start {load_start}, end {meta['load_average_1_5_15']['end']} "
        f"(the benchmark itself adds ~{torch.get_num_threads()})."
    )
    cols = ["decode_tokens", "prompt_tokens", "paged_decode_tok_s", "contiguous_decode_tok_s", "paged/contiguous",
            "paged/contiguous_median", "runs", "cv", "target_met(>=0.95)"]
    _, md = write_results(f"paged-vs-contiguous-{model_label(model)}", meta, rows, cols, note)
    print(md.read_text(), flush=True)
    return rows
