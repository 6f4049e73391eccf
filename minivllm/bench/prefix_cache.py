"""`minivllm bench prefix-cache`: the tables of "Why My Prefix Cache Missed Identical
Requests" (and the original's prefix-reuse report), re-run on this engine.

Prompts are the original's synthetic document: N paragraphs of "{namespace} paragraph
{i}: A distributed inference engine schedules requests, ..." and a closing "{namespace}
question {v}: Summarize the context in one sentence." Every case uses its own
namespace, so nothing is shared between cases by accident.

Cases (fresh engine per case and run, one warm-up workload on it first whose pages are
then dropped from the cache; mean ± sample std over the runs):

  warm-prefix   a seed request (document A), then a probe sharing 0/25/50/75/100% of its
                paragraphs and asking another question; the probe's TTFT with the prefix
                cache off and on (target: >= 97% lower at 100%; original 96.2%).
  cold-burst    4 identical requests submitted together to a cold cache: off, publication
                at completion, incremental, and single-flight after prefill.
  incremental   one request runs; when its first token is out, N more with the same
                prompt arrive: publication at completion vs incremental (N = 2, 4, 8).
  single-flight N identical requests together, incremental publication off: independent
                (publish at completion), single-flight released at the leader's
                completion, and after its prefill (N = 2, 4, 8). N = 8 is also the burst
                table (target: after_prefill mean TTFT >= 85% lower; original 82.9%).
  distinct      8 different prompts together: everything off vs prefix cache +
                incremental + single-flight after_prefill (no regression expected).

TTFT is arrival -> first token (RequestMetrics); "slowest completion" is the largest
arrival -> finish time in the run. Settings follow the original's prefix benchmark:
16-token pages, max_batched_tokens 2048, 8 active requests, FCFS, greedy, ignore_eos.

Runs: per case (one strategy of a table row) at least `repeats` runs, each on its own fresh
engine as above; then more while the coefficient of variation of a number its table reports
exceeds 5%, up to `max_repeats` runs (`common.runs_until_stable`). Watched: the probe's TTFT
(warm-prefix); mean TTFT and slowest completion (cold-burst, single-flight, distinct); mean
TTFT and the followers' mean TTFT (incremental). A row of one case records `runs`, each
watched `<measure>_cv`, `cv` (their max) and `stopped`; a row of two cases (warm-prefix's
off/on, incremental's at_completion/incremental) records `<case>_runs`, `<case>_cv`,
`<case>_stopped` and the watched `<column>_cv`, plus `cv` and `stopped` over both. The
settings record every case's rounds.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from minivllm.bench.common import (
    CV_TARGET,
    StableRuns,
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
from minivllm.sampling.outputs import RequestOutput
from minivllm.sampling.sampling_params import SamplingParams

PARTS = ("warm-prefix", "cold-burst", "incremental", "single-flight", "distinct")
OVERLAPS = (0, 25, 50, 75, 100)
OFF = {"prefix_cache": False}
AT_COMPLETION = {"prefix_cache": True, "publication": "at_completion"}
INCREMENTAL = {"prefix_cache": True, "publication": "incremental"}
SF_COMPLETION = {"prefix_cache": True, "publication": "at_completion", "single_flight": "at_completion"}
SF_PREFILL = {"prefix_cache": True, "publication": "at_completion", "single_flight": "after_prefill"}
SF_PREFILL_INCREMENTAL = {"prefix_cache": True, "publication": "incremental", "single_flight": "after_prefill"}
WATCHED = ("mean_ttft_s", "slowest_completion_s")  # the measures a one-case row's runs watch (see Runs above)


def paragraph(namespace: str, i: int) -> str:
    return (f"{namespace} paragraph {i}: A distributed inference engine schedules requests, allocates cache pages, "
            f"runs model layers, and streams generated tokens to its clients. This paragraph provides deterministic "
            f"benchmark context.")


def document(namespace: str, paragraphs: int, question: int = 1, *, shared_from: str | None = None,
             shared: int = 0) -> str:
    """`paragraphs` paragraphs (the first `shared` taken from namespace `shared_from`) and a question."""
    parts = [paragraph(shared_from if i < shared else namespace, i) for i in range(paragraphs)]
    return "\n".join(parts + [f"{namespace} question {question}: Summarize the context in one sentence."])


class Bench:
    """One loaded model; a fresh engine per case run. Collects every case's rounds (`rounds`, and
    `record` for the settings)."""

    def __init__(self, llm: LLM, *, engine_options: dict, page_size: int, max_batched_tokens: int,
                 max_active_requests: int, output_tokens: int, max_model_len: int, repeats: int = 1,
                 max_repeats: int = 1):
        self.llm = llm
        self.repeats, self.max_repeats = repeats, max_repeats
        self.rounds: list[StableRuns] = []
        self.record: list[dict] = []
        self.tok = llm.tokenizer
        self.base = dict(page_size=page_size, max_batched_tokens=max_batched_tokens,
                         max_active_requests=max_active_requests, max_model_len=max_model_len, **engine_options)
        self.params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
        self._warm_ns = 0

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def engine(self, options: dict, warm_rows: int) -> LLMEngine:
        """A fresh engine, warmed up with `warm_rows` distinct requests of staggered lengths (so
        every decode batch size from warm_rows down to 1 has run, and on CUDA has its graph), then
        emptied: its cache pages are dropped so every measured case starts cold."""
        engine = LLMEngine(self.llm.model, self.tok, EngineConfig(**self.base, **options))
        self._warm_ns += 1
        for i in range(warm_rows):
            ids = self.ids(document(f"warmup{self._warm_ns}x{i}", 4))
            engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=3 + 3 * i, ignore_eos=True))
        drain(engine)
        engine.reset_stats()
        return engine


def drain(engine: LLMEngine) -> list[RequestOutput]:
    rids = engine.request_ids()
    while engine.has_unfinished():
        engine.step()
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)
    return [engine.pop_output(r) for r in rids]


def submit(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[str]:
    return [engine.add_request(ids, params) for ids in prompts]


def run_together(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    submit(engine, prompts, params)
    return _checked(drain(engine), params)


def run_after_first_token(engine: LLMEngine, first: list[int], later: list[list[int]],
                          params: SamplingParams) -> list[RequestOutput]:
    """Submit `first`; when its first token is out, submit `later`; run to the end."""
    rid = engine.add_request(first, params)
    while not engine.request_state(rid).output_ids:
        engine.step()
    submit(engine, later, params)
    return _checked(drain(engine), params)


def _checked(outs: list[RequestOutput], params: SamplingParams) -> list[RequestOutput]:
    for o in outs:
        if o.finish_reason != "length" or len(o.token_ids) != params.max_tokens:
            raise RuntimeError(f"request {o.request_id} ended {o.finish_reason!r} after {len(o.token_ids)} tokens")
    return outs


def measures(outs: list[RequestOutput]) -> dict:
    ttft = [o.metrics.time_to_first_token_s for o in outs]
    return {"mean_ttft_s": sum(ttft) / len(ttft), "slowest_completion_s": max(o.metrics.e2e_s for o in outs),
            "restored": [o.metrics.cached_prompt_tokens for o in outs], "ttft": ttft}


def repeat(bench: Bench, once, watched: tuple[str, ...], case: dict) -> tuple[dict, list[dict], StableRuns]:
    """Run `once()` (which returns measures) at least `bench.repeats` times, more while the CV of a
    `watched` measure exceeds 5%, at most `bench.max_repeats` times; mean ± std of each measure.
    `case` names the case in the settings' record of rounds."""
    rounds = runs_until_stable(once, min_runs=bench.repeats, max_runs=bench.max_repeats, cv_target=CV_TARGET,
                               key=lambda m: [m[k] for k in watched])
    bench.rounds.append(rounds)
    bench.record.append({**case, **rounds.info(), "watched": list(watched)})
    runs = rounds.samples
    row: dict = {}
    for key in ("mean_ttft_s", "slowest_completion_s"):
        record_stat(row, key, [r[key] for r in runs])
    row["restored"] = runs[-1]["restored"]
    return row, runs, rounds


def _record_case(row: dict, label: str, rounds: StableRuns, watched: list[str]) -> None:
    """One case of a two-case row: `<label>_runs`, each watched column's `<name>_cv`, `<label>_cv`,
    `<label>_stopped`; the row's `cv` and `stopped` cover every case recorded so far."""
    row[f"{label}_runs"] = rounds.runs
    for name, cv in zip(watched, rounds.cvs, strict=True):
        row[f"{name}_cv"] = cv
    row[f"{label}_cv"], row[f"{label}_stopped"] = rounds.cv, rounds.stopped
    row["cv"] = max(row.get("cv", 0.0), rounds.cv)
    row["stopped"] = "max_runs" if "max_runs" in (row.get("stopped"), rounds.stopped) else "stable"


def cut(before: float, after: float) -> float:
    return 100.0 * (1.0 - after / before) if before > 0 else 0.0


# -- the cases ---------------------------------------------------------------------------------


def warm_prefix(bench: Bench, paragraphs: int, probe_tokens: int) -> list[dict]:
    rows = []
    seed_params = SamplingParams(temperature=0.0, max_tokens=probe_tokens, ignore_eos=True)
    for overlap in OVERLAPS:
        shared = round(paragraphs * overlap / 100)
        ns = f"overlap{overlap}"
        seed = bench.ids(document(f"{ns}seed", paragraphs, 1))
        probe = bench.ids(document(f"{ns}probe", paragraphs, 2, shared_from=f"{ns}seed", shared=shared))
        row = {"overlap_pct": overlap, "input_tokens": len(probe)}
        for label, options in (("off", OFF), ("on", INCREMENTAL)):
            def once(options=options, seed=seed, probe=probe):
                engine = bench.engine(options, warm_rows=1)
                run_together(engine, [seed], seed_params)
                return measures(run_together(engine, [probe], seed_params))
            stats, runs, rounds = repeat(bench, once, ("mean_ttft_s",),
                                         {"table": "warm-prefix", "overlap_pct": overlap, "case": label})
            _record_case(row, label, rounds, [f"ttft_{label}_s"])
            row.update(
                {
                    f"ttft_{label}_s": stats["mean_ttft_s_mean"],
                    f"ttft_{label}_s_std": stats["mean_ttft_s_std"],
                    f"ttft_{label}": f"{stats['mean_ttft_s_mean'] * 1e3:.1f} ± {stats['mean_ttft_s_std'] * 1e3:.1f} ms",
                }
            )
            row[f"samples_{label}"] = [r["mean_ttft_s"] for r in runs]
            if label == "on":
                row["restored"] = stats["restored"][0]
        row["ttft_cut_pct"] = cut(row["ttft_off_s"], row["ttft_on_s"])
        rows.append(row)
        print(f"warm-prefix {overlap}%: restored {row['restored']} of {row['input_tokens']}, TTFT {row['ttft_off']} -> "
              f"{row['ttft_on']} ({row['ttft_cut_pct']:.1f}% lower)", flush=True)
    for row in rows:
        row["target_met(100%,>=97%)"] = row["ttft_cut_pct"] >= 97.0 if row["overlap_pct"] == 100 else None
    return rows


def cold_burst(bench: Bench, paragraphs: int, n: int = 4) -> list[dict]:
    prompt = bench.ids(document("coldburst", paragraphs))
    rows = []
    for label, options in (("cache off", OFF), ("publication at_completion", AT_COMPLETION),
                           ("publication incremental", INCREMENTAL), ("single-flight after_prefill", SF_PREFILL)):
        def once(options=options):
            return measures(run_together(bench.engine(options, warm_rows=n), [prompt] * n, bench.params))
        stats, runs, rounds = repeat(bench, once, WATCHED, {"table": "cold-burst", "case": label})
        row = {"strategy": label, "requests": n, "input_tokens": len(prompt),
               "restored_per_request": stats["restored"], **stats, "samples": runs}
        record_rounds(row, rounds, list(WATCHED))
        rows.append(row)
        print(f"cold-burst {label}: restored {stats['restored']}, mean TTFT {stats['mean_ttft_s']}", flush=True)
    return rows


def incremental(bench: Bench, paragraphs: int, groups: tuple[int, ...]) -> list[dict]:
    rows = []
    for n in groups:
        prompt = bench.ids(document(f"incremental{n}", paragraphs))
        row = {"followers": n, "input_tokens": len(prompt)}
        for label, options in (("at_completion", AT_COMPLETION), ("incremental", INCREMENTAL)):
            def once(options=options, prompt=prompt, n=n):
                outs = run_after_first_token(bench.engine(options, warm_rows=n + 1), prompt, [prompt] * n, bench.params)
                m = measures(outs)
                m["followers_mean_ttft_s"] = sum(m["ttft"][1:]) / n
                return m
            stats, runs, rounds = repeat(bench, once, ("mean_ttft_s", "followers_mean_ttft_s"),
                                         {"table": "incremental", "followers": n, "case": label})
            _record_case(row, label, rounds, [f"{label}_mean_ttft_s", f"{label}_followers_ttft_s"])
            record_stat(row, f"{label}_mean_ttft_s", [r["mean_ttft_s"] for r in runs])
            record_stat(row, f"{label}_followers_ttft_s", [r["followers_mean_ttft_s"] for r in runs])
            row[f"{label}_restored_per_follower"] = sorted(set(stats["restored"][1:]))
            row[f"{label}_samples"] = runs
        row["mean_ttft_cut_pct"] = cut(row["at_completion_mean_ttft_s_mean"], row["incremental_mean_ttft_s_mean"])
        rows.append(row)
        print(f"incremental N={n}: restored/follower {row['incremental_restored_per_follower']}, mean TTFT "
              f"{row['at_completion_mean_ttft_s']} -> {row['incremental_mean_ttft_s']} "
              f"({row['mean_ttft_cut_pct']:.1f}% lower)", flush=True)
    return rows


def single_flight(bench: Bench, paragraphs: int, groups: tuple[int, ...]) -> list[dict]:
    rows = []
    for n in groups:
        prompt = bench.ids(document(f"flight{n}", paragraphs))
        for label, options in (("independent", AT_COMPLETION), ("at_completion", SF_COMPLETION),
                               ("after_prefill", SF_PREFILL)):
            def once(options=options, prompt=prompt, n=n):
                return measures(run_together(bench.engine(options, warm_rows=n), [prompt] * n, bench.params))
            stats, runs, rounds = repeat(bench, once, WATCHED, {"table": "single-flight", "requests": n, "case": label})
            row = {"requests": n, "release": label, "input_tokens": len(prompt),
                   "restored_per_follower": sorted(set(stats["restored"][1:])), **stats, "samples": runs}
            record_rounds(row, rounds, list(WATCHED))
            rows.append(row)
            print(f"single-flight N={n} {label}: mean TTFT {stats['mean_ttft_s']}, slowest "
                  f"{stats['slowest_completion_s']}, restored {stats['restored']}", flush=True)
    by = {(r["requests"], r["release"]): r for r in rows}
    for r in rows:
        base = by[(r["requests"], "independent")]
        r["mean_ttft_change_pct"] = -cut(base["mean_ttft_s_mean"], r["mean_ttft_s_mean"])
        r["slowest_completion_change_pct"] = -cut(base["slowest_completion_s_mean"], r["slowest_completion_s_mean"])
        r["target_met(N=8,after_prefill,<=-85%)"] = (
            r["mean_ttft_change_pct"] <= -85.0 if (r["requests"], r["release"]) == (8, "after_prefill") else None
        )
        if r["release"] == "after_prefill":
            r["ttft_cut_vs_at_completion_pct"] = cut(by[(r["requests"], "at_completion")]["mean_ttft_s_mean"],
                                                     r["mean_ttft_s_mean"])
    return rows


def distinct(bench: Bench, paragraphs: int, n: int = 8) -> list[dict]:
    prompts = [bench.ids(document(f"distinct{i}", paragraphs)) for i in range(n)]
    rows = []
    for label, options in (("everything off", OFF), ("prefix cache + incremental + single-flight after_prefill",
                                                      SF_PREFILL_INCREMENTAL)):
        def once(options=options):
            return measures(run_together(bench.engine(options, warm_rows=n), prompts, bench.params))
        stats, runs, rounds = repeat(bench, once, WATCHED, {"table": "distinct", "case": label})
        row = {"setting": label, "requests": n, "restored": stats["restored"], **stats, "samples": runs}
        record_rounds(row, rounds, list(WATCHED))
        rows.append(row)
        print(
            f"distinct {label}: mean TTFT {stats['mean_ttft_s']}, slowest {stats['slowest_completion_s']}", flush=True
        )
    base, on = rows
    for key in ("mean_ttft_s", "slowest_completion_s"):
        on[f"{key}_ratio_vs_off"] = on[f"{key}_mean"] / base[f"{key}_mean"]
    return rows


# -- the driver ---------------------------------------------------------------------------------


def run(model: str = "smollm2-135m", device: str = "cpu", dtype: str = "f32", *, repeats: int = 3,
        max_repeats: int | None = None, output_tokens: int | None = None, parts: list[str] | None = None,
        groups: tuple[int, ...] = (2, 4, 8), page_size: int = 16, max_batched_tokens: int = 2048,
        max_active_requests: int = 8, synthetic: str | None = None, synthetic_tokenizer: str | None = None,
        engine_options: dict | None = None) -> dict[str, list[dict]]:
    """Per case at least `repeats` runs, more while a watched TTFT or completion time varies by more
    than 5% (CV), at most `max_repeats` (default 3 x repeats); each run on a fresh engine."""
    parts = parts or list(PARTS)
    for p in parts:
        if p not in PARTS:
            raise ConfigError("parts", p, f"allowed: {', '.join(PARTS)}")
    if repeats < 1:
        raise ConfigError("repeats", repeats, "must be >= 1")
    max_repeats = default_max_repeats(repeats, max_repeats)
    if synthetic is not None:
        from minivllm.bench.synthetic_model import ensure_synthetic_model

        model = str(ensure_synthetic_model(synthetic, tokenizer_source=synthetic_tokenizer))
    load_start = loadavg()
    llm = LLM(model, device=device, dtype=dtype, progress=False, max_model_len=64, prefix_cache=False)
    # The original's outputs are 128 tokens; on a CPU that is most of the run time and
    # changes no TTFT, so CPU runs default to 32 (recorded in the settings).
    output_tokens = output_tokens or (32 if llm.model.device.type == "cpu" else 128)
    bench = Bench(llm, engine_options=engine_options or {}, page_size=page_size, max_batched_tokens=max_batched_tokens,
                  max_active_requests=max_active_requests, output_tokens=output_tokens,
                  max_model_len=min(llm.config.context_length, 1536), repeats=repeats, max_repeats=max_repeats)
    label = f"synthetic-{synthetic}" if synthetic else model_label(model)
    settings = {"model": model, "synthetic": synthetic, "inference_device": device, "activation_dtype": dtype,
                "repeats": repeats, "max_repeats": max_repeats, "cv_target": CV_TARGET, "page_size": page_size,
                "max_batched_tokens": max_batched_tokens,
                "max_active_requests": max_active_requests, "policy": "fcfs", "output_tokens": output_tokens,
                "sampling": "greedy, ignore_eos", "torch_threads": torch.get_num_threads(),
                "engine_options": engine_options or {},
                "kernel_options": bench.engine({}, warm_rows=0).kernel_options.describe(),
                "method": "fresh engine per case run; warm-up workload on it first, then its cache pages dropped"}
    sha = sha256_file(Path(llm.model_path))
    tables: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    if "warm-prefix" in parts:
        tables["warm-prefix"] = warm_prefix(bench, paragraphs=24, probe_tokens=16)
    if "cold-burst" in parts:
        tables["cold-burst"] = cold_burst(bench, paragraphs=24)
    if "incremental" in parts:
        tables["incremental"] = incremental(bench, paragraphs=13, groups=groups)
    if "single-flight" in parts:
        tables["single-flight"] = single_flight(bench, paragraphs=14, groups=groups)
    if "distinct" in parts:
        tables["distinct"] = distinct(bench, paragraphs=14)
    settings["wall_s"] = round(time.perf_counter() - t0, 1)
    settings["rounds"] = bench.record  # per case: runs, its watched measures' CVs ("cvs", in "watched" order), stopped
    meta = provenance(str(llm.model.device) if llm.model.device.type == "cuda" else device, sha, settings)
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    rows = [{"table": name, **row} for name, table in tables.items() for row in table]
    over_runs = runs_note(bench.rounds, repeats, max_repeats, "case's TTFT or slowest completion")
    notes = render_tables(tables, over_runs)
    json_path, md_path = write_results(f"prefix-cache-{label}-{llm.model.device.type}", meta, rows,
                                       ["table", "cv", "stopped"], notes)
    print(notes, flush=True)
    print(f"wrote {json_path} and {md_path}", flush=True)
    return tables


def _ms(row: dict, key: str) -> str:
    return f"{row[key + '_mean'] * 1e3:,.1f} ± {row[key + '_std'] * 1e3:,.1f}"


def render_tables(tables: dict[str, list[dict]], runs_note: str) -> str:
    """The article's tables in Markdown (times in ms, mean ± sample std; `runs_note` says over how many runs)."""
    out = [f"Times in ms, {runs_note}; each run on a fresh, warmed-up engine. Column Runs: a case's runs "
           f"(several cases of a row separated by /).", ""]
    if "warm-prefix" in tables:
        out += ["## Warm-prefix reuse (seed, then a probe sharing part of its document)", "",
                "| Overlap | Input | Restored | TTFT off | TTFT on | TTFT cut | Runs (off/on) |",
                "|---|---|---|---|---|---|---|"]
        for r in tables["warm-prefix"]:
            out.append(f"| {r['overlap_pct']}% | {r['input_tokens']} | {r['restored']} | "
                       f"{r['ttft_off_s'] * 1e3:,.1f} ± {r['ttft_off_s_std'] * 1e3:,.1f} | "
                       f"{r['ttft_on_s'] * 1e3:,.1f} ± {r['ttft_on_s_std'] * 1e3:,.1f} | {r['ttft_cut_pct']:.1f}% | "
                       f"{r['off_runs']}/{r['on_runs']} |")
        out.append("")
    if "cold-burst" in tables:
        out += ["## 4 identical requests to a cold cache", "",
                "| Strategy | Input | Restored per request | Mean TTFT | Slowest completion | Runs |",
                "|---|---|---|---|---|---|"]
        for r in tables["cold-burst"]:
            out.append(f"| {r['strategy']} | {r['input_tokens']} | {r['restored_per_request']} | "
                       f"{_ms(r, 'mean_ttft_s')} | {_ms(r, 'slowest_completion_s')} | {r['runs']} |")
        out.append("")
    if "incremental" in tables:
        out += ["## Incremental publication: N identical requests arrive after a running request's first token", "",
                "| Followers | Input | Restored per follower | Mean TTFT, publish at completion | Mean TTFT, "
                "incremental | Cut | Followers' TTFT, at completion | Followers' TTFT, incremental | "
                "Runs (at completion/incremental) |", "|---|---|---|---|---|---|---|---|---|"]
        for r in tables["incremental"]:
            out.append(
                f"| {r['followers']} | {r['input_tokens']} | {r['incremental_restored_per_follower']} | "
                f"{_ms(r, 'at_completion_mean_ttft_s')} | {_ms(r, 'incremental_mean_ttft_s')} | "
                f"{r['mean_ttft_cut_pct']:.1f}% | {_ms(r, 'at_completion_followers_ttft_s')} | "
                f"{_ms(r, 'incremental_followers_ttft_s')} | {r['at_completion_runs']}/{r['incremental_runs']} |"
            )
        out.append("")
    if "single-flight" in tables:
        rows = tables["single-flight"]
        by = {(r["requests"], r["release"]): r for r in rows}
        out += ["## Single-flight: simultaneous identical requests, mean TTFT by release policy", "",
                "| Requests | Independent | Release at leader completion | Release after prefill | Cut (after "
                "prefill vs at completion) | Runs |", "|---|---|---|---|---|---|"]
        for n in sorted({r["requests"] for r in rows}):
            a, b, c = by[(n, "independent")], by[(n, "at_completion")], by[(n, "after_prefill")]
            out.append(f"| {n} | {_ms(a, 'mean_ttft_s')} | {_ms(b, 'mean_ttft_s')} | {_ms(c, 'mean_ttft_s')} | "
                       f"{c['ttft_cut_vs_at_completion_pct']:.1f}% | {a['runs']}/{b['runs']}/{c['runs']} |")
        big = max(r["requests"] for r in rows)
        out += ["", f"## The {big}-request burst vs independent execution (incremental publication off)", "",
                "| Strategy | Restored per follower | Mean TTFT | Change | Slowest completion | Change | Runs |",
                "|---|---|---|---|---|---|---|"]
        for label, name in (("independent", "Independent execution, publish at completion"),
                            ("at_completion", "Single flight, release at request completion"),
                            ("after_prefill", "Single flight, release after prompt publication")):
            r = by[(big, label)]
            base = label == "independent"
            restored = [0] if base else r["restored_per_follower"]
            ttft_change = "baseline" if base else f"{r['mean_ttft_change_pct']:+.1f}%"
            slowest_change = "baseline" if base else f"{r['slowest_completion_change_pct']:+.1f}%"
            out.append(f"| {name} | {restored} | {_ms(r, 'mean_ttft_s')} | {ttft_change} | "
                       f"{_ms(r, 'slowest_completion_s')} | {slowest_change} | {r['runs']} |")
        out.append("")
    if "distinct" in tables:
        rows = tables["distinct"]
        out += ["## Distinct-input control (8 different prompts together)", "",
                "| Setting | Restored | Mean TTFT | Slowest completion | Runs |", "|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['setting']} | {sum(r['restored'])} | {_ms(r, 'mean_ttft_s')} | "
                       f"{_ms(r, 'slowest_completion_s')} | {r['runs']} |")
        on = rows[1]
        out += ["", f"Ratio on/off: mean TTFT {on['mean_ttft_s_ratio_vs_off']:.3f}, slowest completion "
                    f"{on['slowest_completion_s_ratio_vs_off']:.3f}.", ""]
    return "\n".join(out)
