"""`minivllm bench speculative`: the speculative-decoding tables of the original's
"speculative decoding policies" report and of "What I Gave Up to Make Speculative
Decoding Faster", re-run on this engine.

Tables:
  greedy    a code-refactoring and a creative-writing prompt (data/speculative/), greedy:
            target-only, fixed 4/6/8, acceptance-rate, accepted-length, adaptive
            (acceptance-rate behind the pay-off gate), and the draft model alone as a
            control. Greedy output does not depend on a seed, so each case runs `runs`
            times (or more while its e2e time varies; see Runs below).
  sampling  the creative prompt at temperature 0.7: target-only, then a fixed draft length
            (default 8, the article's) with TV budgets 0 (lossless), 0.5, 0.75 and 1, and
            the draft alone; `seeds` seeds x `runs` runs.

Method: one request at a time, `max_tokens` (256) generated with EOS ignored, prefix cache
off (so every run computes its prompt). Each case gets a fresh engine over the shared
weights, a warm-up generation on it, then the timed runs. Columns: acceptance
(accepted / proposed), verification rounds per request, median e2e, mean ± std of decode
tok/s ((tokens - 1) / (e2e - TTFT)) and of overall tok/s (tokens / e2e), and the speed-up
of the median e2e over target-only in the same run. The generated texts are saved with
the numbers (the Markdown file lists them), so a reader can see what a faster lossy
setting changed.

Runs: a run is one generation per seed (greedy: one, no seed), on the case's one engine.
Per case at least `runs` runs; then more while, for any seed, the e2e time across the runs
so far varies by more than 5% (coefficient of variation), up to `max_runs` runs
(`common.runs_until_stable`). Watched per seed, not pooled over seeds: seeds generate
different texts, so their e2e times differ by design (acceptance, rounds), and a pooled CV
would measure the seeds rather than the timing noise. The engine stays one per case (fresh,
warmed up) as before; only the number of runs on it changes. Each row records `runs`, the
watched `e2e_s_cv` (greedy) or `e2e_s_seed<k>_cv` (sampling), `cv` (their max) and
`stopped`; the settings record every case's rounds.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from minivllm.bench.common import (
    CV_TARGET,
    StableRuns,
    loadavg,
    model_label,
    provenance,
    record_rounds,
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

DATA = Path(__file__).resolve().parents[2] / "data" / "speculative"
PROMPTS = {"code": "code_refactor.txt", "creative": "creative_writing.txt"}
PARTS = ("greedy", "sampling")
GREEDY_CASES = [("target-only", None), ("fixed-4", "fixed:4"), ("fixed-6", "fixed:6"), ("fixed-8", "fixed:8"),
                ("acceptance-rate", "acceptance-rate"), ("accepted-length", "accepted-length"),
                ("adaptive", "adaptive"), ("draft-only", "draft-only")]


def prompt_text(name: str) -> str:
    path = DATA / PROMPTS[name]
    if not path.exists():
        raise ConfigError("prompt", name, f"{path} is missing; run from a minivllm checkout (data/speculative/)")
    return path.read_text().strip()


class Bench:
    def __init__(self, llm: LLM, engine_options: dict, max_tokens: int):
        self.llm = llm
        self.max_tokens = max_tokens
        self.rounds: list[StableRuns] = []  # every case's, in order
        self.record: list[dict] = []        # the same for the settings
        self.options = {"prefix_cache": False, "max_model_len": 2048, "max_active_requests": 2,
                        "max_batched_tokens": 1024, **engine_options}

    def engine(self, policy: str | None, tv_budget: float = 0.0) -> LLMEngine:
        llm = self.llm
        if policy == "draft-only":
            return LLMEngine(llm.draft, llm.draft_tokenizer, EngineConfig(**self.options))
        if policy is None:
            return LLMEngine(llm.model, llm.tokenizer, EngineConfig(**self.options))
        config = EngineConfig(**self.options, draft_policy=policy, tv_budget=tv_budget)
        return LLMEngine(llm.model, llm.tokenizer, config, draft_model=llm.draft, draft_tokenizer=llm.draft_tokenizer,
                         draft_name=llm.draft_model_path.name)

    def once(self, engine: LLMEngine, ids: list[int], params: SamplingParams) -> dict:
        rid = engine.add_request(ids, params)
        while engine.has_unfinished():
            engine.step()
        out = engine.pop_output(rid)
        m = out.metrics
        if out.finish_reason != "length" or len(out.token_ids) != params.max_tokens:
            raise RuntimeError(f"run ended with {out.finish_reason} after {len(out.token_ids)} tokens")
        spec = m.speculation or {}
        return {"e2e_s": m.e2e_s, "ttft_s": m.time_to_first_token_s, "tokens": len(out.token_ids),
                "decode_tok_s": m.decode_tokens_per_s, "tok_s": len(out.token_ids) / m.e2e_s,
                "proposed": spec.get("proposed", 0), "accepted": spec.get("accepted", 0),
                "bonus": spec.get("bonus_tokens", 0), "rounds": spec.get("rounds", 0),
                "plain_steps": spec.get("plain_steps", 0), "histogram": spec.get("draft_length_histogram", {}),
                "tv_mean": spec.get("tv_mean"), "text": out.text}

    def case(self, label: str, policy: str | None, ids: list[int], *, runs: int, seeds: list[int | None],
             temperature: float, tv_budget: float = 0.0, max_runs: int | None = None, table: str = "") -> dict:
        """At least `runs` runs of every seed on one fresh engine, more while a seed's e2e CV exceeds
        5%, at most `max_runs` (default `runs`)."""
        engine = self.engine(policy, tv_budget)
        warm = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=0)
        self.once(engine, ids, warm)
        done = 0

        def one_run() -> list[dict]:  # every seed once
            nonlocal done
            out = []
            for seed in seeds:
                params = SamplingParams(temperature=temperature, max_tokens=self.max_tokens, ignore_eos=True,
                                        seed=seed)
                sample = self.once(engine, ids, params)
                sample.update(run=done, seed=seed)
                out.append(sample)
            done += 1
            return out

        rounds = runs_until_stable(one_run, min_runs=runs, max_runs=runs if max_runs is None else max_runs,
                                   cv_target=CV_TARGET, key=lambda r: [s["e2e_s"] for s in r])
        watched = ["e2e_s" if seed is None else f"e2e_s_seed{seed}" for seed in seeds]
        self.rounds.append(rounds)
        self.record.append({"table": table, "case": label, **rounds.info(), "watched": watched})
        row = summarize_case(label, policy, tv_budget, [s for r in rounds.samples for s in r])
        record_rounds(row, rounds, watched)
        return row


def summarize_case(label: str, policy: str | None, tv_budget: float, samples: list[dict]) -> dict:
    e2e = [s["e2e_s"] for s in samples]
    dec = [s["decode_tok_s"] for s in samples]
    tps = [s["tok_s"] for s in samples]
    proposed = sum(s["proposed"] for s in samples)
    accepted = sum(s["accepted"] for s in samples)
    histogram: dict[str, int] = {}
    for s in samples:
        for k, v in s["histogram"].items():
            histogram[k] = histogram.get(k, 0) + v
    tvs = [s["tv_mean"] for s in samples if s["tv_mean"] is not None]
    texts = {}
    for s in samples:
        texts.setdefault(str(s["seed"]), s["text"])  # the first run's text per seed
    return {
        "case": label, "policy": policy, "tv_budget": tv_budget, "n": len(samples),
        "acceptance": accepted / proposed if proposed else None, "accepted": accepted, "proposed": proposed,
        "rounds_per_request": statistics.fmean(s["rounds"] for s in samples),
        "plain_steps_per_request": statistics.fmean(s["plain_steps"] for s in samples),
        "bonus_per_request": statistics.fmean(s["bonus"] for s in samples),
        "e2e_median_s": statistics.median(e2e), "e2e_mean_s": statistics.fmean(e2e),
        "e2e_std_s": statistics.stdev(e2e) if len(e2e) > 1 else 0.0,
        "ttft_median_s": statistics.median(s["ttft_s"] for s in samples),
        "decode_tok_s_mean": statistics.fmean(dec), "decode_tok_s_std": statistics.stdev(dec) if len(dec) > 1 else 0.0,
        "tok_s_mean": statistics.fmean(tps), "tok_s_std": statistics.stdev(tps) if len(tps) > 1 else 0.0,
        "draft_length_histogram": histogram, "tv_mean": statistics.fmean(tvs) if tvs else None,
        "texts": texts, "samples": [{k: v for k, v in s.items() if k != "text"} for s in samples],
    }


def add_ratios(rows: list[dict]) -> None:
    base = next((r for r in rows if r["policy"] is None), None)
    for r in rows:
        if base is not None:
            r["speedup_e2e"] = base["e2e_median_s"] / r["e2e_median_s"]
            r["decode_ratio"] = r["decode_tok_s_mean"] / base["decode_tok_s_mean"]


def run(
    target: str = "qwen2.5-coder-1.5b",
    draft: str = "qwen2.5-coder-0.5b",
    device: str = "cpu",
    dtype: str = "f32",
    *,
    max_tokens: int = 256,
    runs: int = 3,
    max_runs: int | None = None,
    seeds: int = 3,
    parts: list[str] | None = None,
    prompts: list[str] | None = None,
    cases: list[str] | None = None,
    sampling_policy: str = "fixed:8",
    tv_budgets: tuple[float, ...] = (0.0, 0.5, 0.75, 1.0),
    temperature: float = 0.7,
    engine_options: dict | None = None,
    synthetic_pair: bool = False,
    synthetic_tokenizer: str | None = None,
) -> dict[str, list[dict]]:
    """`sampling_policy` may list several policies separated by "/" (each gets every TV budget).
    `synthetic_pair`: a synthetic Qwen2.5-7B Q4_K_M target and a 0.5B-class draft with
    random weights (GPU timing without downloads): acceptance then means nothing except at
    TV budget 1, where every draft token is accepted, which isolates what a round costs.
    Per case at least `runs` runs (each one generation per seed), more while a seed's e2e time
    varies by more than 5% (CV), at most `max_runs` (default 3 x runs)."""
    parts = parts or list(PARTS)
    prompts = prompts or list(PROMPTS)
    for p in parts:
        if p not in PARTS:
            raise ConfigError("parts", p, f"allowed: {', '.join(PARTS)}")
    for p in prompts:
        if p not in PROMPTS:
            raise ConfigError("prompts", p, f"allowed: {', '.join(PROMPTS)}")
    known = [c for c, _ in GREEDY_CASES]
    for c in cases or []:
        if c not in known:
            raise ConfigError("cases", c, f"allowed: {', '.join(known)}")
    if runs < 1 or seeds < 1 or max_tokens < 2:
        raise ConfigError(
            "runs/seeds/max_tokens", (runs, seeds, max_tokens), "need runs >= 1, seeds >= 1, max_tokens >= 2"
        )
    max_runs = 3 * runs if max_runs is None else max_runs
    if max_runs < runs:
        raise ConfigError("max_runs", max_runs, f"must be >= runs ({runs})")
    if synthetic_pair:
        from minivllm.bench.synthetic_model import QWEN25_05B_CLASS, QWEN25_7B, ensure_synthetic_model

        target = str(ensure_synthetic_model(QWEN25_7B.name, tokenizer_source=synthetic_tokenizer))
        draft = str(ensure_synthetic_model(QWEN25_05B_CLASS.name, tokenizer_source=synthetic_tokenizer))
    load_start = loadavg()
    t_load = time.perf_counter()
    llm = LLM(target, device=device, dtype=dtype, progress=False, draft_model=draft, prefix_cache=False)
    load_s = time.perf_counter() - t_load
    bench = Bench(llm, engine_options or {}, max_tokens)
    # Through the chat template, as a user would send them; a model without one (the
    # tests' tiny models) gets the plain text.
    chat = llm.tokenizer.chat_template is not None
    ids = {p: llm.tokenizer.encode(llm.chat_prompt([{"role": "user", "content": prompt_text(p)}]) if chat
                                   else prompt_text(p)) for p in prompts}
    tables: dict[str, list[dict]] = {}
    t0 = time.perf_counter()
    if "greedy" in parts:
        rows = []
        for p in prompts:
            table = []
            for label, policy in GREEDY_CASES:
                if cases and label not in cases and label != "target-only":
                    continue
                row = bench.case(label, policy, ids[p], runs=runs, max_runs=max_runs, seeds=[None], temperature=0.0,
                                 table=f"greedy {p}")
                row["prompt"] = p
                table.append(row)
                print(f"greedy {p} {label}: median e2e {row['e2e_median_s']:.2f} s, acceptance {row['acceptance']} "
                      f"({row['runs']} runs, {row['stopped']})", flush=True)
            add_ratios(table)
            rows += table
        tables["greedy"] = rows
    if "sampling" in parts:
        p = "creative" if "creative" in prompts else prompts[0]
        table = []
        sampling_cases = [("target-only", None, 0.0)] + [
            (f"{policy} TV={d:g}", policy, d) for policy in sampling_policy.split("/") for d in tv_budgets] + [
            ("draft-only", "draft-only", 0.0)]
        for label, policy, d in sampling_cases:
            row = bench.case(label, policy, ids[p], runs=runs, max_runs=max_runs, seeds=list(range(seeds)),
                             temperature=temperature, tv_budget=d, table=f"sampling {p}")
            row["prompt"] = p
            table.append(row)
            print(f"sampling {label}: median e2e {row['e2e_median_s']:.2f} s, acceptance {row['acceptance']} "
                  f"({row['runs']} runs, {row['stopped']})", flush=True)
        add_ratios(table)
        tables["sampling"] = table
    settings = {
        "target": target,
        "draft": draft,
        "synthetic_pair": synthetic_pair,
        "inference_device": device,
        "activation_dtype": dtype,
        "max_tokens": max_tokens,
        "runs": runs,
        "max_runs": max_runs,
        "cv_target": CV_TARGET,
        "seeds": seeds,
        "temperature_sampling": temperature,
        "sampling_policy": sampling_policy,
        "tv_budgets": list(tv_budgets),
        "prompts": prompts,
        "prompt_tokens": {p: len(v) for p, v in ids.items()},
        "chat_template": chat,
        "ignore_eos": True,
        "engine_options": bench.options,
        "torch_threads": torch.get_num_threads(),
        "kernel_options": bench.engine(None).kernel_options.describe(),
        "load_s": round(load_s, 1),
        "method": "one request at a time; fresh engine per case with a 16-token warm-up; prefix cache off",
    }
    settings["wall_s"] = round(time.perf_counter() - t0, 1)
    settings["rounds"] = bench.record  # per case: runs, each watched seed's e2e CV ("cvs", in "watched" order), stopped
    meta = provenance(str(llm.model.device) if llm.model.device.type == "cuda" else device,
                      sha256_file(Path(llm.model_path)), settings)
    meta["draft_model_sha256"] = sha256_file(Path(llm.draft_model_path))
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    rows = [{"table": name, **row} for name, table in tables.items() for row in table]
    notes = render(tables, runs_note(bench.rounds, runs, max_runs, "seed's e2e time") if bench.rounds else "")
    label = f"{model_label(target)}-from-{model_label(draft)}-{llm.model.device.type}"
    json_path, md_path = write_results(f"speculative-{label}", meta, rows, ["table", "prompt", "case", "runs", "cv"],
                                       notes)
    print(notes, flush=True)
    print(f"wrote {json_path} and {md_path}", flush=True)
    return tables


def _pm(row: dict, key: str) -> str:
    return f"{row[key + '_mean']:.2f} ± {row[key + '_std']:.2f}"


def render(tables: dict[str, list[dict]], runs_note: str = "") -> str:
    """The tables in Markdown; `runs_note` (over how many runs, how they stopped) heads them."""
    out = [f"decode tok/s and tok/s: {runs_note}, pooled over the seeds; column runs: a case's runs "
           f"(each one generation per seed).", ""] if runs_note else []
    for name, rows in tables.items():
        out += [f"## {name}", "", "| prompt | case | acceptance | rounds/req | plain steps/req | median e2e (s) | "
                "decode tok/s | tok/s | speed-up (median e2e) | decode ratio | draft lengths | runs |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            acc = "—" if r["acceptance"] is None else f"{r['acceptance']:.1%} ({r['accepted']}/{r['proposed']})"
            out.append(f"| {r['prompt']} | {r['case']} | {acc} | {r['rounds_per_request']:.1f} | "
                       f"{r['plain_steps_per_request']:.1f} | {r['e2e_median_s']:.2f} | {_pm(r, 'decode_tok_s')} | "
                       f"{_pm(r, 'tok_s')} | {r.get('speedup_e2e', 0):.3f}x | {r.get('decode_ratio', 0):.3f}x | "
                       f"{r['draft_length_histogram'] or '—'} | {r.get('runs', '')} |")
        out.append("")
    out += ["## Generated texts", ""]
    for name, rows in tables.items():
        for r in rows:
            for seed, text in r["texts"].items():
                out += [f"### {name} / {r['prompt']} / {r['case']} / seed {seed}", "", "```text", text, "```", ""]
    return "\n".join(out)
