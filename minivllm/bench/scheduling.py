"""Scheduling policies: head-of-line blocking and fairness between long prefills.

Repeats the original's policy experiments (reference §4.8) on the synchronous engine.
Every workload is submitted at once, in arrival order, to a fresh `LLMEngine` with a small
`max_batched_tokens`, so prefills are chunked; the engine is then stepped until done.
TTFT (arrival -> first token) comes from RequestMetrics. Greedy, `ignore_eos`, exactly
`max_tokens` outputs per request.

(a) head of line: K long prompts first, then one short one. Under fcfs the short request
    waits for every long prefill; shortest-prefill-first serves it first. Reported: the
    short request's TTFT, the long ones' TTFTs (the cost), and the short TTFT relative to
    fcfs in the same run.
(b) fairness: M long prompts together. Reported: the spread of their TTFTs (max - min and
    the std across requests), the oldest request's TTFT, and that TTFT relative to fcfs in
    the same run (round-robin's cost to the oldest request).

A fresh engine per run: round-robin's rotation cursor lives in the scheduler and would
otherwise carry over from one run into the next.

Runs: per workload at least `repeats` rounds, each running every policy once (fcfs first), then
whole rounds continue while a watched TTFT of any policy varies by more than 5% (coefficient of
variation), up to `max_repeats` rounds (`common.runs_until_stable`). Watched: (a) the short
request's TTFT and the long ones' mean TTFT; (b) the oldest request's TTFT and the later ones'
mean TTFT. Not the spread (max - min TTFT): a difference of near-equal TTFTs (round-robin's
aim) has an unbounded CV and would run every fairness workload to the maximum. Each row
records its `runs` and its watched CVs; the settings record each workload's rounds.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from minivllm.bench.common import (
    CV_TARGET,
    default_max_repeats,
    loadavg,
    model_label,
    provenance,
    record_stat,
    runs_note,
    runs_until_stable,
)
from minivllm.bench.results import write_results
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import POLICIES, EngineConfig
from minivllm.engine.llm import LLM
from minivllm.errors import ConfigError
from minivllm.models.cache import sha256_file
from minivllm.sampling.sampling_params import SamplingParams

PROMPTS_FILE = Path(__file__).resolve().parents[2] / "data" / "prompts.json"


def make_prompt(tokenizer, seed_text: str, n_tokens: int) -> list[int]:
    """Exactly n_tokens ids: seed_text repeated until long enough, then truncated."""
    ids: list[int] = []
    piece = tokenizer.encode(seed_text + "\n")
    while len(ids) < n_tokens:
        ids += piece
    return ids[:n_tokens]


def run_workload(llm: LLM, policy: str, prompts: list[list[int]], max_tokens: int, max_batched_tokens: int,
                 page_size: int) -> dict:
    """Submit all prompts at once (in order) to a fresh engine and step until done."""
    cfg = EngineConfig(kv_mode="paged", page_size=page_size, max_batched_tokens=max_batched_tokens,
                       max_active_requests=len(prompts), policy=policy,
                       max_model_len=max(map(len, prompts)) + max_tokens + 1)
    engine = LLMEngine(llm.model, llm.tokenizer, cfg)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rids = [engine.add_request(ids, params) for ids in prompts]
    while engine.has_unfinished():
        engine.step()
    if llm.model.device.type == "cuda":
        torch.cuda.synchronize(llm.model.device)
    wall = time.perf_counter() - t0
    outs = [engine.pop_output(r) for r in rids]
    for o in outs:
        if o.finish_reason != "length" or len(o.token_ids) != max_tokens:
            raise RuntimeError(f"{o.request_id}: {o.finish_reason!r} after {len(o.token_ids)} tokens, "
                               f"expected 'length' after {max_tokens}")
    ttft = [o.metrics.time_to_first_token_s for o in outs]
    if not all(t > 0 for t in ttft) or any(o.metrics.e2e_s < o.metrics.time_to_first_token_s for o in outs):
        raise RuntimeError(f"implausible metrics: {[o.metrics.as_dict() for o in outs]}")
    return {"ttft": ttft, "wall": wall, "output_tok_s": len(prompts) * max_tokens / wall,
            "steps": engine.counters["steps"], "preemptions": engine.counters["preemptions"]}


def run(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "f32", *,
        policies: list[str] | None = None, repeats: int = 3, max_repeats: int | None = None, long_prompts: int = 3,
        long_tokens: int = 400, short_tokens: int = 16, fair_prompts: int = 4, fair_tokens: int = 400,
        max_batched_tokens: int = 64, max_tokens: int = 16, page_size: int = 16) -> dict[str, list[dict]]:
    """Run both experiments; returns {"head_of_line": rows, "fairness": rows} (one row per policy). Per
    workload at least `repeats` rounds of every policy, more while a watched TTFT's CV exceeds 5%, at most
    `max_repeats` (default 3 x repeats)."""
    policies = policies or list(POLICIES)
    for p in policies:
        if p not in POLICIES:
            raise ConfigError("policies", p, f"allowed: {', '.join(POLICIES)}")
    if "fcfs" not in policies:
        policies = ["fcfs", *policies]  # the baseline every ratio is taken against
    if repeats < 1:
        raise ConfigError("repeats", repeats, "must be >= 1")
    max_repeats = default_max_repeats(repeats, max_repeats)
    if not short_tokens < max_batched_tokens < long_tokens:
        raise ConfigError(
            "max_batched_tokens",
            max_batched_tokens,
            f"the workloads need short ({short_tokens}) < budget < long ({long_tokens}) so prefills are chunked",
        )
    llm = LLM(model, device=device, dtype=dtype, progress=False, max_model_len=64)
    sha = sha256_file(llm.model_path)
    tok = llm.tokenizer
    texts = json.loads(PROMPTS_FILE.read_text())["prompts"]
    # Distinct seed texts, so no two prompts share a prefix.
    hol = [make_prompt(tok, texts[i % len(texts)], long_tokens) for i in range(long_prompts)]
    hol.append(make_prompt(tok, texts[-1], short_tokens))
    fair = [make_prompt(tok, texts[(long_prompts + i) % len(texts)], fair_tokens) for i in range(fair_prompts)]
    load_start = loadavg()

    def workload(prompts):
        return lambda policy: run_workload(llm, policy, prompts, max_tokens, max_batched_tokens, page_size)

    # The TTFTs each workload watches, per policy (see the module docstring); names as in the rows.
    watched = {"head_of_line": {"short_ttft_s": lambda r: r["ttft"][-1],
                                "long_ttft_mean_s": lambda r: statistics.fmean(r["ttft"][:-1])},
               "fairness": {"oldest_ttft_s": lambda r: r["ttft"][0],
                            **({"later_mean_ttft_s": lambda r: statistics.fmean(r["ttft"][1:])}
                               if fair_prompts > 1 else {})}}
    results, rounds = {}, {}
    for name, fn in (("head_of_line", workload(hol)), ("fairness", workload(fair))):
        fn(policies[0])  # warm-up

        def one_round(fn=fn) -> dict[str, dict]:  # policies alternate within each run: ratios compare neighbours
            return {p: fn(p) for p in policies}

        rounds[name] = runs_until_stable(
            one_round, min_runs=repeats, max_runs=max_repeats, cv_target=CV_TARGET,
            key=lambda m, name=name: [get(m[p]) for p in policies for get in watched[name].values()])
        results[name] = {p: [m[p] for m in rounds[name].samples] for p in policies}
        print(f"{name}: done, {rounds[name].runs} runs ({rounds[name].stopped})", flush=True)

    def record(row: dict, name: str, i: int) -> None:
        """The workload's runs, the CVs of policy i's watched TTFTs (`<name>_cv`) and their max."""
        k = len(watched[name])
        mine = rounds[name].cvs[i * k:(i + 1) * k]
        row["runs"] = rounds[name].runs
        for key, cv in zip(watched[name], mine, strict=True):
            row[f"{key}_cv"] = cv
        row["cv"], row["stopped"] = max(mine), rounds[name].stopped  # stopped: the workload's (all policies)

    hol_rows = []
    base = results["head_of_line"]["fcfs"]
    for i, p in enumerate(policies):
        rs = results["head_of_line"][p]
        row = {"policy": p, "long_prompts": long_prompts, "long_tokens": long_tokens, "short_tokens": short_tokens}
        record_stat(row, "short_ttft_s", [r["ttft"][-1] for r in rs])
        record_stat(row, "long_ttft_mean_s", [statistics.fmean(r["ttft"][:-1]) for r in rs])
        record_stat(row, "oldest_long_ttft_s", [r["ttft"][0] for r in rs])
        record_stat(row, "short_ttft_vs_fcfs", [r["ttft"][-1] / b["ttft"][-1] for r, b in zip(rs, base)])
        record_stat(row, "long_ttft_vs_fcfs", [statistics.fmean(r["ttft"][:-1]) / statistics.fmean(b["ttft"][:-1])
                                         for r, b in zip(rs, base)])
        record_stat(row, "wall_s", [r["wall"] for r in rs])
        record_stat(row, "output_tok_s", [r["output_tok_s"] for r in rs])
        row["steps"] = rs[0]["steps"]
        record(row, "head_of_line", i)
        row["samples"] = {"ttft": [r["ttft"] for r in rs], "wall": [r["wall"] for r in rs]}
        hol_rows.append(row)

    fair_rows = []
    base = results["fairness"]["fcfs"]
    for i, p in enumerate(policies):
        rs = results["fairness"][p]
        row = {"policy": p, "prompts": fair_prompts, "prompt_tokens": fair_tokens}
        record_stat(row, "oldest_ttft_s", [r["ttft"][0] for r in rs])
        record_stat(
            row, "later_mean_ttft_s", [statistics.fmean(r["ttft"][1:]) for r in rs] if fair_prompts > 1 else [0.0]
        )
        record_stat(row, "spread_s", [max(r["ttft"]) - min(r["ttft"]) for r in rs])
        record_stat(row, "ttft_std_s", [statistics.stdev(r["ttft"]) if fair_prompts > 1 else 0.0 for r in rs])
        record_stat(row, "oldest_ttft_vs_fcfs", [r["ttft"][0] / b["ttft"][0] for r, b in zip(rs, base)])
        record_stat(row, "spread_vs_fcfs", [(max(r["ttft"]) - min(r["ttft"])) / (max(b["ttft"]) - min(b["ttft"]))
                                      if max(b["ttft"]) > min(b["ttft"]) else float("nan") for r, b in zip(rs, base)])
        record_stat(row, "wall_s", [r["wall"] for r in rs])
        row["steps"] = rs[0]["steps"]
        record(row, "fairness", i)
        row["samples"] = {"ttft": [r["ttft"] for r in rs], "wall": [r["wall"] for r in rs]}
        fair_rows.append(row)

    dev = llm.model.device
    settings = {"model": model, "inference_device": device, "activation_dtype": dtype, "repeats": repeats,
                "max_repeats": max_repeats, "cv_target": CV_TARGET,
                "rounds": {name: {**r.info(), "watched": [f"{p} {key}" for p in policies for key in watched[name]]}
                           for name, r in rounds.items()},  # its "cvs" in the order of its "watched"
                "warmup_runs": 1, "policies": policies, "long_prompts": long_prompts, "long_tokens": long_tokens,
                "short_tokens": short_tokens, "fair_prompts": fair_prompts, "fair_tokens": fair_tokens,
                "max_batched_tokens": max_batched_tokens, "max_tokens": max_tokens, "page_size": page_size,
                "kv_mode": "paged", "max_active_requests": "one per prompt", "sampling": "greedy, ignore_eos",
                "engine": "synchronous LLMEngine, fresh per run, all requests submitted at once in arrival order",
                "torch_threads": torch.get_num_threads()}
    meta = provenance(device if dev.type != "cuda" else str(dev), sha, settings)
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    common = (f"after a warm-up; policies alternate within each run and the *_vs_fcfs ratios are per run. "
              f"max_batched_tokens={max_batched_tokens}, {max_tokens} output tokens per request, all requests "
              f"submitted at once in arrival order. Load average (1/5/15 min) at start {load_start}, end "
              f"{meta['load_average_1_5_15']['end']} (the benchmark itself adds ~{torch.get_num_threads()}).")
    cols = ["policy", "short_ttft_s", "short_ttft_s_median", "short_ttft_vs_fcfs", "long_ttft_mean_s",
            "oldest_long_ttft_s", "long_ttft_vs_fcfs", "output_tok_s", "wall_s", "runs", "cv"]
    _, md_a = write_results(
        f"scheduling-head-of-line-{model_label(model)}",
        meta,
        hol_rows,
        cols,
        f"Head of line: {long_prompts} long prompts of {long_tokens} tokens, then one short prompt "
        f"of {short_tokens} tokens. TTFTs in seconds; "
        + runs_note([rounds["head_of_line"]], repeats, max_repeats, "policy's short or long-mean TTFT")
        + " "
        + common,
    )
    cols_b = ["policy", "oldest_ttft_s", "later_mean_ttft_s", "spread_s", "spread_s_median", "ttft_std_s",
              "oldest_ttft_vs_fcfs", "spread_vs_fcfs", "wall_s", "runs", "cv"]
    _, md_b = write_results(
        f"scheduling-fairness-{model_label(model)}",
        meta,
        fair_rows,
        cols_b,
        f"Fairness: {fair_prompts} prompts of {fair_tokens} tokens together; spread = max - min "
        f"TTFT, ttft_std = std of the TTFTs across requests. Seconds; "
        + runs_note([rounds["fairness"]], repeats, max_repeats, "policy's oldest or later-mean TTFT")
        + " "
        + common,
    )
    print(md_a.read_text())
    print(md_b.read_text())
    return {"head_of_line": hol_rows, "fairness": fair_rows}
