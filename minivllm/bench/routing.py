"""`minivllm bench routing`: the experiment of "When LLM Inference on CPU Beats Waiting for
the GPU", re-run on `Cluster`: does routing some of a burst to another (slower) worker
finish the burst sooner than forcing it all onto the fastest one?

Workload (the article's): every prompt is exactly `prompt_tokens` token ids, a shared
prefix of `prefix_tokens` ids (a whole number of KV pages: 496 = 31 pages of 16 for a
516-token prompt) cut from data/speculative/code_refactor.txt (repeated as needed),
then a tail unique to the request ("\nRequest N:" and the text that follows the prefix).
Greedy, EOS ignored, exactly `max_tokens` output tokens. The token ids are submitted as
lists, so every policy sees the same prompts.

Per (policy, burst), with `fresh_per_run` (the default): for each run a fresh Cluster
(max_active_requests=max_active on every worker), the prefix seeded into every worker's
prefix cache by one request of prefix + a short tail pinned to that worker, then the
burst: a submitting thread sends request i at i * arrival_ms without waiting for any
response, a consumer thread per request timestamps its first token and its end.
`fresh_per_run=False` starts one cluster per (policy, burst) and re-seeds it before each
run: 2-3x quicker on a small model (a start costs a load, a warm-up and a calibration per
worker), but runs are no longer independent: later runs inherit the online-corrected
rates, the round-robin cursor and whatever earlier runs left in the caches (the tails are
unique per run, so only the prefix is ever reused either way).

Policies: any `--router` policy (round-robin, least-loaded, cost, forced:<worker>) and
"forced-fastest": before the measured cases, the first cluster's calibrated rates
(`snapshot()["workers"][i]["rates"]`) price one request alone on each worker,
(prompt - prefix) / prefill_tps + max_tokens / decode_tps[1]; the lowest is "the fastest
worker" and the policy is forced:<that worker> for every run of the invocation.

Per run: completion time (first submission -> last finish), output throughput (output
tokens / completion time), TTFT and end-to-end p50/p95 measured by the client (from just
before `submit()` to the first token / the end) and by the engine (arrival at the worker
-> first token / finish), requests per worker, cached prompt tokens. Per (policy, burst):
mean ± sample std over the runs, and the mean throughput and completion time relative to
forced-fastest's in the same invocation. The cost router's decision records (every
candidate's active/queued, cache estimate, terms and score) are kept for every cost run:
they are the article's diagnostic table. Wall times exclude start-up and seeding.

Runs: per (policy, burst) at least `runs` runs (each on a fresh cluster by default, as
above); then more while the completion time varies by more than 5% across the runs so far
(coefficient of variation), up to `max_runs` runs (default 3 x runs;
`common.runs_until_stable`). Each row records the count as `runs_n` (its `runs` key already
holds the per-run records), `completion_s_cv`, `cv` (the same: one watched series) and
`stopped`; the settings record every case's rounds.
"""

from __future__ import annotations

import math
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from minivllm.bench.common import (
    CV_TARGET,
    StableRuns,
    loadavg,
    model_label,
    provenance,
    record_stat,
    runs_note,
    runs_until_stable,
)
from minivllm.bench.common import percentile as _percentile
from minivllm.bench.results import write_results
from minivllm.errors import ConfigError
from minivllm.models.cache import sha256_file
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.router import Router, parse_router_policy

TEXT_FILE = Path(__file__).resolve().parents[2] / "data" / "speculative" / "code_refactor.txt"
FORCED_FASTEST = "forced-fastest"
DEFAULTS = {"bursts": [8, 48], "runs": 3, "max_tokens": 128, "prompt_tokens": 516, "prefix_tokens": 496}
QUICK = {"bursts": [4], "runs": 1, "max_tokens": 8, "prompt_tokens": 64, "prefix_tokens": 48}
DEFAULT_POLICIES = [FORCED_FASTEST, "round-robin", "cost"]
DEFAULT_DEVICES = ["cpu:1", "cpu:1"]
RESULT_TIMEOUT_S = 3600.0
# The per-run measures that get mean ± std per (policy, burst).
MEASURES = ("completion_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s", "e2e_p95_s",
            "engine_ttft_p50_s", "engine_ttft_p95_s", "engine_e2e_p50_s", "engine_e2e_p95_s",
            "cached_prompt_tokens", "output_tokens")


def backend_label(info: dict, device: dict | None = None) -> str:
    """"CPU (4 threads)" or "GPU cuda:0 (NVIDIA H200, sm_90)" from a worker's info
    (`cluster.snapshot()["workers"][i]["info"]`)."""
    spec = info.get("device_spec") or device or {}
    if spec.get("kind") == "cuda" or str(info.get("device", "")).startswith("cuda"):
        return f"GPU {info.get('device') or spec.get('torch_device')}"
    threads, name = spec.get("threads"), spec.get("name") or info.get("name")
    label = "CPU" if name in (None, "", "cpu") else f"CPU {name}"
    return f"{label} ({threads} thread{'s' if threads != 1 else ''})" if threads else label


def percentile(values: list[float], q: float) -> float:
    return _percentile(values, q, empty=math.nan)


# -- the workload ------------------------------------------------------------------------------


class Workload:
    def __init__(self, tokenizer, *, prompt_tokens: int, prefix_tokens: int, page_size: int):
        if prefix_tokens % page_size:
            whole = prefix_tokens - prefix_tokens % page_size
            print(f"routing: --prefix-tokens {prefix_tokens} is not a whole number of {page_size}-token pages; "
                  f"using {whole}", flush=True)
            prefix_tokens = whole
        if not 0 <= prefix_tokens < prompt_tokens:
            raise ConfigError("prefix_tokens", prefix_tokens, f"must be in [0, prompt_tokens={prompt_tokens})")
        self.tok = tokenizer
        self.prompt_tokens, self.prefix_tokens, self.page_size = prompt_tokens, prefix_tokens, page_size
        text = TEXT_FILE.read_text()
        stream = tokenizer.encode(text)  # BOS as the model wants it, once
        while len(stream) < prompt_tokens + 64:
            stream += tokenizer.encode("\n\n" + text, add_bos=False)
        self.prefix = stream[:prefix_tokens]
        self.filler = stream[prefix_tokens:]

    def prompt(self, uid: int) -> list[int]:
        tail_len = self.prompt_tokens - self.prefix_tokens
        tag = self.tok.encode(f"\nRequest {uid}:", add_bos=False)
        tail = (tag + self.filler)[:tail_len]
        return self.prefix + tail

    def prompts(self, run: int, burst: int) -> list[list[int]]:
        """The burst of run `run`: unique tails (the token after the prefix pages differ), same for every policy."""
        prompts = [self.prompt(run * burst + i) for i in range(burst)]
        first_page = {tuple(p[self.prefix_tokens:self.prefix_tokens + self.page_size]) for p in prompts}
        if len(first_page) < len(prompts):
            raise ConfigError("prompt_tokens", self.prompt_tokens, f"leaves a {self.prompt_tokens - self.prefix_tokens}"
                              "-token tail, too short to make every request's tail unique; raise it or lower "
                              "--prefix-tokens")
        return prompts

    def seed_prompt(self, worker: str) -> list[int]:
        return self.prefix + self.tok.encode(f"\nSeed for worker {worker}:", add_bos=False)


# -- one run -------------------------------------------------------------------------------------


@dataclass
class Sent:
    index: int
    prompt: list[int]
    submitted: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    stream: object = None


def _consume(sent: Sent) -> None:
    for event in sent.stream:
        now = time.perf_counter()
        if sent.first_token is None and event.token_id >= 0:
            sent.first_token = now
        if event.finished:
            sent.finished = now


def seed(cluster, workload: Workload) -> dict[str, int]:
    """One request of prefix + a short tail pinned to every worker, waited for; returns
    each worker's cached tokens of the seed prompt (from its engine metrics, i.e. before seeding: 0 when cold)."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    streams = {name: cluster.submit(workload.seed_prompt(name), params, worker=name) for name in cluster.workers}
    out = {}
    for name, stream in streams.items():
        result = stream.result(RESULT_TIMEOUT_S)
        if result.finish_reason == "error":
            raise RuntimeError(f"seeding worker {name} failed: {stream.error}")
        out[name] = result.metrics.cached_prompt_tokens
    return out


def burst_run(cluster, prompts: list[list[int]], params: SamplingParams, arrival_s: float) -> dict:
    """Submit `prompts` from a submitting thread, request i at i * arrival_s, without waiting for
    responses; wait for all; the run's measures and per-request records."""
    sent = [Sent(i, p) for i, p in enumerate(prompts)]
    consumers: list[threading.Thread] = []
    failure: list[BaseException] = []

    def submitter(t0: float) -> None:
        try:
            for s in sent:
                delay = t0 + s.index * arrival_s - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                s.submitted = time.perf_counter()
                s.stream = cluster.submit(s.prompt, params)
                c = threading.Thread(target=_consume, args=(s,), name=f"routing-consumer-{s.index}", daemon=True)
                c.start()
                consumers.append(c)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            failure.append(exc)

    t0 = time.perf_counter()
    thread = threading.Thread(target=submitter, args=(t0,), name="routing-submitter", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    outputs = []
    for s in sent:
        out = s.stream.result(RESULT_TIMEOUT_S)
        if out.finish_reason != "length" or len(out.token_ids) != params.max_tokens:
            raise RuntimeError(f"request {s.index} on {s.stream.worker} ended {out.finish_reason!r} after "
                               f"{len(out.token_ids)} tokens: {s.stream.error}")
        outputs.append(out)
    for c in consumers:
        c.join(60)
    start = sent[0].submitted
    end = max(s.finished for s in sent)
    completion = end - start
    ttft = [s.first_token - s.submitted for s in sent]
    e2e = [s.finished - s.submitted for s in sent]
    engine_ttft = [o.metrics.time_to_first_token_s for o in outputs]
    engine_e2e = [o.metrics.e2e_s for o in outputs]
    output_tokens = sum(len(o.token_ids) for o in outputs)
    per_worker = {name: 0 for name in cluster.workers}
    for s in sent:
        per_worker[s.stream.worker] += 1
    requests = [{"index": s.index, "request_id": s.stream.request_id, "worker": s.stream.worker,
                 "reason": s.stream.decision.get("reason") if s.stream.decision else None,
                 "submitted_at_s": s.submitted - start, "ttft_s": ttft[i], "e2e_s": e2e[i],
                 "engine_ttft_s": engine_ttft[i], "engine_e2e_s": engine_e2e[i],
                 "engine_queue_s": o.metrics.queue_time_s, "prompt_tokens": o.metrics.prompt_tokens,
                 "cached_prompt_tokens": o.metrics.cached_prompt_tokens, "output_tokens": len(o.token_ids)}
                for i, (s, o) in enumerate(zip(sent, outputs))]
    return {"completion_s": completion, "output_tok_s": output_tokens / completion,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "e2e_p50_s": percentile(e2e, 50), "e2e_p95_s": percentile(e2e, 95),
            "engine_ttft_p50_s": percentile(engine_ttft, 50), "engine_ttft_p95_s": percentile(engine_ttft, 95),
            "engine_e2e_p50_s": percentile(engine_e2e, 50), "engine_e2e_p95_s": percentile(engine_e2e, 95),
            "cached_prompt_tokens": sum(o.metrics.cached_prompt_tokens for o in outputs),
            "output_tokens": output_tokens, "requests_per_worker": per_worker,
            "last_submission_s": sent[-1].submitted - start, "requests": requests,
            "_request_ids": {s.stream.request_id for s in sent}}


# -- the driver --------------------------------------------------------------------------------------


def fastest_worker(workers: list[dict], prompt_tokens: int, prefix_tokens: int, max_tokens: int) -> tuple[str, dict]:
    """The worker that would finish one request alone soonest, by its calibrated rates."""
    scores = {}
    for w in workers:
        rates = w.get("rates") or {}
        prefill, decode = rates.get("prefill_tps"), (rates.get("decode_tps") or {}).get("1")
        if not prefill or not decode:
            raise ConfigError("policies", FORCED_FASTEST, f"worker {w['name']} has no calibrated rates; "
                              "forced-fastest needs calibration (do not pass calibrate=false)")
        scores[w["name"]] = {"prefill_tps": prefill, "decode_tps_1": decode,
                             "one_request_s": (prompt_tokens - prefix_tokens) / prefill + max_tokens / decode}
    return min(scores, key=lambda n: scores[n]["one_request_s"]), scores


def run(*args, backend: str = "local", ray_address: str | None = None, **kwargs) -> list[dict]:
    """`run_cases` with the workers on `backend`: "local" processes, or "ray" actors on the
    cluster at `ray_address` (None: a private Ray instance, joined once here so that the
    fresh cluster of every run does not start Ray again)."""
    own_ray = False
    if backend == "ray":
        from minivllm.serving.ray_transport import connect

        own_ray = connect(ray_address)
    try:
        return run_cases(*args, backend=backend, ray_address=ray_address, **kwargs)
    finally:
        if own_ray:
            import ray

            ray.shutdown()


def run_cases(model: str = "smollm2-135m", devices: list[str] | None = None, dtype: str = "f32", *,
        bursts: list[int] | None = None, policies: list[str] | None = None, runs: int | None = None,
        max_runs: int | None = None, max_tokens: int | None = None, prompt_tokens: int | None = None,
        prefix_tokens: int | None = None, arrival_ms: float = 50.0, max_active: int = 4, fresh_per_run: bool = True,
        quick: bool = False, engine_options: dict | None = None, backend: str = "local",
        ray_address: str | None = None) -> list[dict]:
    """Run every (burst, policy) case; write benchmarks/results/routing-<model>-<stamp>.{json,md};
    return the aggregate rows (each with its per-run records under "runs"). Per (policy, burst) at
    least `runs` runs, more while the completion time's CV exceeds 5%, at most `max_runs` (default
    3 x runs)."""
    from minivllm.serving import Cluster

    base = QUICK if quick else DEFAULTS

    def pick(value, key):  # an explicit value beats --quick's and the default
        return base[key] if value is None else value

    bursts = list(pick(bursts, "bursts"))
    runs, max_tokens = pick(runs, "runs"), pick(max_tokens, "max_tokens")
    prompt_tokens, prefix_tokens = pick(prompt_tokens, "prompt_tokens"), pick(prefix_tokens, "prefix_tokens")
    devices = list(devices or DEFAULT_DEVICES)
    policies = list(policies or DEFAULT_POLICIES)
    for p in policies:
        if p != FORCED_FASTEST:
            parse_router_policy(p)
    if runs < 1:
        raise ConfigError("runs", runs, "must be >= 1")
    max_runs = 3 * runs if max_runs is None else max_runs
    if max_runs < runs:
        raise ConfigError("max_runs", max_runs, f"must be >= runs ({runs})")
    if not bursts or any(b < 1 for b in bursts):
        raise ConfigError("bursts", bursts, "give one or more burst sizes >= 1")
    if not 0 <= prefix_tokens < prompt_tokens:
        raise ConfigError("prefix_tokens", prefix_tokens, f"must be in [0, prompt_tokens={prompt_tokens})")
    engine_options = dict(engine_options or {})
    engine_options["max_active_requests"] = max_active
    if engine_options.get("prefix_cache") is False or engine_options.get("kv_mode") == "contiguous":
        print("routing: the prefix cache is off, so the seeded prefix will not be reused", flush=True)
    page_size = int(engine_options.get("page_size", 16))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    load_start = loadavg()

    state: dict = {"fastest": None, "fastest_scores": None, "workers": None, "sha": None, "workload": None}

    def start(policy: str):
        router = policy
        if policy == FORCED_FASTEST:
            router = f"forced:{state['fastest']}" if state["fastest"] else "round-robin"
        cluster = Cluster(model, devices, router=router, dtype=dtype, backend=backend, ray_address=ray_address,
                          **engine_options).start()
        snap = cluster.snapshot()
        if state["workers"] is None:
            state["workers"] = [{"name": w["name"], "device": w["device"], "threads": w["threads"],
                                 "backend": backend_label(w["info"]), "device_info": w["info"].get("device"),
                                 "max_model_len": w["info"].get("max_model_len"),
                                 "kv_pages": w["info"].get("kv_pages")} for w in snap["workers"]]
            state["sha"] = sha256_file(Path(cluster.model_path))
            state["workload"] = Workload(cluster.tokenizer, prompt_tokens=prompt_tokens, prefix_tokens=prefix_tokens,
                                         page_size=page_size)
        if FORCED_FASTEST in policies and state["fastest"] is None:
            state["fastest"], state["fastest_scores"] = fastest_worker(snap["workers"], prompt_tokens,
                                                                       state["workload"].prefix_tokens, max_tokens)
            print(f"routing: fastest single worker by calibrated rates: {state['fastest']} "
                  + ", ".join(f"{n} {s['one_request_s']:.3f} s" for n, s in state["fastest_scores"].items()),
                  flush=True)
            if policy == FORCED_FASTEST:
                cluster.router = Router(f"forced:{state['fastest']}")  # nothing routed yet
        rates = {w["name"]: {"prefill_tps": w["rates"].get("prefill_tps"), "decode_tps": w["rates"].get("decode_tps")}
                 for w in snap["workers"]}
        return cluster, rates

    rows: list[dict] = []
    all_rounds: list[StableRuns] = []
    t_all = time.perf_counter()
    for burst in bursts:
        for policy in policies:
            records = []
            cluster = rates = None

            def one_run(burst=burst, policy=policy, records=records) -> dict:
                nonlocal cluster, rates
                r = len(records)
                if cluster is None or fresh_per_run:
                    if cluster is not None:
                        cluster.stop()
                    cluster, rates = start(policy)
                workload = state["workload"]
                seeded = seed(cluster, workload)
                rec = burst_run(cluster, workload.prompts(r, burst), params, arrival_ms / 1000.0)
                ids = rec.pop("_request_ids")
                rec.update({"run": r + 1, "router": cluster.router.policy, "rates_at_start": rates,
                            "seed_cached_tokens": seeded})
                if cluster.router.policy == "cost":
                    rec["decisions"] = [d for d in cluster.snapshot()["router"]["decisions"] if d["request_id"] in ids]
                records.append(rec)
                print(f"routing burst={burst} {policy} run {r + 1} (at least {runs}, at most {max_runs}): completion "
                      f"{rec['completion_s']:.3f} s, {rec['output_tok_s']:.1f} tok/s, per worker "
                      f"{rec['requests_per_worker']}, cached {rec['cached_prompt_tokens']}", flush=True)
                return rec

            try:
                rounds = runs_until_stable(one_run, min_runs=runs, max_runs=max_runs, cv_target=CV_TARGET,
                                           key="completion_s")
            finally:
                if cluster is not None:
                    cluster.stop()
            all_rounds.append(rounds)
            row = {"burst": burst, "policy": policy, "router": records[0]["router"], "runs_n": rounds.runs,
                   "completion_s_cv": rounds.cvs[0], "cv": rounds.cv, "stopped": rounds.stopped}
            for key in MEASURES:
                record_stat(row, key, [rec[key] for rec in records], column=False)
            names = list(records[0]["requests_per_worker"])
            row["requests_per_worker"] = {n: [rec["requests_per_worker"][n] for rec in records] for n in names}
            row["requests_per_worker_mean"] = {n: statistics.fmean(v) for n, v in row["requests_per_worker"].items()}
            row["runs"] = records
            rows.append(row)
    for row in rows:
        ff = next((r for r in rows if r["burst"] == row["burst"] and r["policy"] == FORCED_FASTEST), None)
        row["throughput_vs_forced_fastest"] = row["output_tok_s_mean"] / ff["output_tok_s_mean"] if ff else None
        row["completion_vs_forced_fastest"] = row["completion_s_mean"] / ff["completion_s_mean"] if ff else None

    workload = state["workload"]
    settings = {"model": model, "inference_devices": devices, "backend": backend, "activation_dtype": dtype,
                "bursts": bursts, "policies": policies, "runs": runs, "max_runs": max_runs, "cv_target": CV_TARGET,
                "rounds": [{"burst": r["burst"], "policy": r["policy"], **rounds.info(), "watched": ["completion_s"]}
                           for r, rounds in zip(rows, all_rounds, strict=True)],
                "max_tokens": max_tokens, "prompt_tokens": prompt_tokens,
                "prefix_tokens": workload.prefix_tokens, "page_size": page_size, "arrival_ms": arrival_ms,
                "max_active_requests": max_active, "engine_options": engine_options, "fresh_per_run": fresh_per_run,
                "quick": quick, "sampling": "greedy, ignore_eos",
                "text": str(TEXT_FILE.relative_to(TEXT_FILE.parents[2])),
                "prompts": "shared prefix + '\\nRequest N:' + following text, N = run * burst + i",
                "wall_s": round(time.perf_counter() - t_all, 1),
                "method": ("fresh cluster per run" if fresh_per_run
                           else "one cluster per (policy, burst), re-seeded per run")
                + "; prefix seeded into every worker by a pinned request; arrivals every arrival_ms from a submitting "
                  "thread; client times from just before submit()"}
    meta = provenance("cpu", state["sha"], settings)
    meta["device"] = " + ".join(f"{w['name']}: {w['backend']}" for w in state["workers"])
    meta["cpu"] = platform.processor() or platform.machine()
    meta["workers"] = state["workers"]
    meta["forced_fastest"] = {"worker": state["fastest"], "scores": state["fastest_scores"]}
    meta["load_average_1_5_15"] = {"start": load_start, "end": loadavg()}
    notes = render(rows, state, settings, runs_note(all_rounds, runs, max_runs, "case's completion time"))
    columns = ["burst", "policy", "router", "completion_s", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "e2e_p50_s",
               "e2e_p95_s", "throughput_vs_forced_fastest", "completion_vs_forced_fastest", "runs_n", "cv"]
    flat = [{**r, **{k: f"{r[k + '_mean']:.4g} ± {r[k + '_std']:.2g}" for k in MEASURES}} for r in rows]
    json_path, md_path = write_results(f"routing-{model_label(model)}" + ("-ray" if backend == "ray" else ""),
                                       meta, flat, columns, notes)
    print(notes, flush=True)
    print(f"wrote {json_path} and {md_path}", flush=True)
    return rows


# -- Markdown ---------------------------------------------------------------------------------------


def _pm(row: dict, key: str, fmt: str = ".3f") -> str:
    return f"{row[key + '_mean']:{fmt}} ± {row[key + '_std']:{fmt}}"


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def render(rows: list[dict], state: dict, settings: dict, runs_note: str | None = None) -> str:
    """The tables in Markdown; `runs_note` (over how many runs, how they stopped) replaces the plain
    "over N run(s)" when given."""
    over = runs_note or f"mean ± sample std over {settings['runs']} run(s)"
    out = [f"Model {settings['model']}, {settings.get('backend', 'local')} backend, workers "
           + ", ".join(f"{w['name']} = {w['backend']}" for w in state["workers"])
           + f"; prompts {settings['prompt_tokens']} tokens ({settings['prefix_tokens']} shared, seeded), "
           f"{settings['max_tokens']} output tokens, arrivals every {settings['arrival_ms']:g} ms, "
           f"max {settings['max_active_requests']} active per worker; {over.replace('column runs', 'column Runs')}, "
           f"{'a fresh cluster per run' if settings['fresh_per_run'] else 'one cluster per case'}. "
           "Times in seconds, client side (submit -> first token / end); completion = first submission -> last end.",
           ""]
    if state["fastest"]:
        out += [f"forced-fastest = forced:{state['fastest']} (one request alone, by calibrated rates: "
                + ", ".join(f"{n} {s['one_request_s']:.3f} s" for n, s in state["fastest_scores"].items()) + ").", ""]
    for burst in sorted({r["burst"] for r in rows}):
        out += [f"## Burst of {burst}", "",
                "| Policy | Completion (s) | Output tok/s | TTFT p50 | TTFT p95 | E2E p50 | E2E p95 "
                "| Requests per worker (per run) | Cached prompt tokens | Throughput vs forced-fastest "
                "| Completion vs forced-fastest | Runs |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["burst"] == burst):
            per_worker = ", ".join(f"{n}: {'/'.join(map(str, v))}" for n, v in r["requests_per_worker"].items())
            label = r["policy"] + (f" ({r['router']})" if r["policy"] == FORCED_FASTEST else "")
            out.append(
                f"| {label} | {_pm(r, 'completion_s')} | {_pm(r, 'output_tok_s', '.1f')} | {_pm(r, 'ttft_p50_s')} | "
                f"{_pm(r, 'ttft_p95_s')} | {_pm(r, 'e2e_p50_s')} | {_pm(r, 'e2e_p95_s')} | {per_worker} | "
                f"{r['cached_prompt_tokens_mean']:.0f} | {_ratio(r['throughput_vs_forced_fastest'])} | "
                f"{_ratio(r['completion_vs_forced_fastest'])} | {r.get('runs_n', len(r['runs']))} |"
            )
        out.append("")
    for r in rows:
        for rec in r["runs"]:
            if rec.get("decisions") and rec["run"] == 1:
                out += decision_table(r["burst"], rec)
    return "\n".join(out)


def decision_table(burst: int, rec: dict) -> list[str]:
    """The article's diagnostic table: what the cost router saw for each request of run 1."""
    names = [c["worker"] for c in rec["decisions"][0]["candidates"]]
    out = [f"### Cost router decisions, burst of {burst}, run 1 (estimates, not measurements)", "",
           "| Request | " + " | ".join(f"{n} active / queued | {n} cached | {n} score (s)" for n in names)
           + " | Selection |", "|---|" + "---|---|---|" * len(names) + "---|"]
    index = {q["request_id"]: q["index"] for q in rec["requests"]}
    for d in rec["decisions"]:
        cells = []
        for c in d["candidates"]:
            score = "—" if c["score"] is None else f"{c['score']:.3f}"
            cells.append(f"{c['active']} / {c['queued']} | {c['cached_tokens']} | {score}")
        reason = "" if d["reason"] == "cost" else f" ({d['reason']})"
        number = index[d["request_id"]] + 1 if d["request_id"] in index else "?"
        out.append(f"| {number} | "
                   + " | ".join(cells) + f" | {d['chosen']}{reason} |")
    out.append("")
    return out
