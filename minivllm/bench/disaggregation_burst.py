"""The burst of `bench disaggregation --burst N` (issue 43): N requests at once to a
cluster whose prefill worker A is at its slot cap, routed by `cost+split`, then, each on
a fresh backlog, by `cost` (no split) and with every request split by hand, so the
router's choices are measured against the same burst without splits and with nothing
but splits (what N splits decoding side by side on B cost).

Why a burst: one request at a time (the cases) shows that a split can pay; a burst shows
what the router does when several requests compete for A's handoff rows and B's slots,
and whether the requests as a whole finish sooner. Per policy it reports each request's
end-to-end time (median, mean ± std), the makespan (submit of the first to the end of the
last), how many were split, and every decision's scores (the articles' table).
"""

from __future__ import annotations

import threading
import time

from minivllm.bench.common import record_stat
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.worker import DEFAULT_STATE_INTERVAL_S

# "split": every request of the burst placed (A, B) by hand, whatever the router would do:
# what splits decoding side by side on B cost, measured beside the router's choices.
POLICIES = ("cost+split", "cost", "split")
STATE_WAIT_S = 2.5 * DEFAULT_STATE_INTERVAL_S  # two of the workers' state reports and a bit


def measure_burst(cluster, a: str, b: str, texts, backlog_cls, run_one, *, burst: int, prompt_tokens: int,
                  max_tokens: int, backlog: int, backlog_tokens: int) -> dict:
    """`backlog_cls.start(...)` pins the long answers on A; `run_one(cluster, prompt, params)`
    times one routed request (disaggregation.timed_request)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {"burst": burst, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "backlog": backlog,
           "policies": {}}
    for policy in POLICIES:
        cluster.set_router("cost" if policy == "split" else policy)
        run = run_one if policy != "split" else (lambda c, prompt, p: run_one(c, prompt, p, placement=(a, b)))
        uid = f"burst.{policy}.{time.monotonic_ns()}"
        load = backlog_cls.start(cluster, a, backlog, texts, backlog_tokens, uid) if backlog else None
        before, t0 = engine_counters(cluster), time.perf_counter()
        cpu_before = process_cpu(cluster)
        results = burst_at_once(cluster, texts, run, params, uid, burst, prompt_tokens, load)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        out["policies"][policy] = summarize(results, a, b)
        # What each worker measured of itself over the burst (aggregate decode tokens/s by
        # batch size, corrected by every step): the rates the router priced with next.
        out["policies"][policy]["rates_after"] = {
            name: {k: h.rates_wire.get(k) for k in ("decode_tps", "observations", "context_s", "calibration_context")}
            for name, h in cluster.workers.items()}
        cpu_after, cpu_seconds = process_cpu(cluster), time.perf_counter() - t0  # the burst alone
        after = engine_counters(cluster)
        out["policies"][policy]["engine_steps"] = steps_during(before, after, time.perf_counter() - t0)
        out["policies"][policy]["cores_busy"] = cores_busy(cpu_before, cpu_after, cpu_seconds)
    cluster.set_router("cost+split")
    split, plain, forced = (out["policies"][p] for p in POLICIES)
    out["mean_e2e_ratio"] = split["e2e_s_mean"] / plain["e2e_s_mean"]
    out["makespan_ratio"] = split["makespan_s"] / plain["makespan_s"]
    out["all_split_mean_e2e_ratio"] = forced["e2e_s_mean"] / plain["e2e_s_mean"]
    return out


def engine_counters(cluster) -> dict:
    """Each worker's engine counters as of its latest state report (every
    state_interval_s), read after one more report has had time to arrive."""
    time.sleep(STATE_WAIT_S)
    return {name: dict((h.snapshot or {}).get("counters") or {}) for name, h in cluster.workers.items()}


def process_cpu(cluster) -> dict:
    """CPU seconds so far (user + system) of each worker's process and of each of its
    threads, of this process (the router and the clients) and of the whole host: who held
    the cores while B decoded. A worker on another node (Ray) is left out."""
    import psutil

    out = {"host": sum(psutil.cpu_times()[:3]), "router": sum(psutil.Process().cpu_times()[:2]), "threads": {}}
    for name, h in cluster.workers.items():
        pid = h.transport.pid if h.transport is not None else None
        try:
            proc = psutil.Process(pid) if pid else None
            out[name] = sum(proc.cpu_times()[:2]) if proc else None
            out["threads"][name] = {t.id: t.user_time + t.system_time for t in proc.threads()} if proc else {}
        except psutil.Error:
            out[name] = None
    return out


def cores_busy(before: dict, after: dict, seconds: float, top: int = 4) -> dict:
    """Average cores each process kept busy between the two reads; `host` is every process
    on the machine (user + nice + system), `host_cores` how many it has. Per worker, its
    busiest threads' cores too: one thread near 1.0 beside idle compute threads is a step
    loop waiting on serial work, not a slow kernel."""
    import psutil

    out = {k: (after[k] - before[k]) / seconds for k in after
           if k != "threads" and after.get(k) is not None and before.get(k) is not None}
    out["host_cores"] = psutil.cpu_count()
    out["busiest_threads"] = {}
    for name, threads in after.get("threads", {}).items():
        then = before.get("threads", {}).get(name, {})
        busy = sorted(((t - then.get(tid, 0.0)) / seconds for tid, t in threads.items()), reverse=True)
        out["busiest_threads"][name] = [round(b, 3) for b in busy[:top]]
    return out


def steps_during(before: dict, after: dict, seconds: float) -> dict:
    """Per worker between the two reads (the burst, its backlog, and up to a state report
    interval either side): steps, prompt and decode tokens, preemptions, decode tokens a
    step, ms inside a step and wall ms a step. A slow step shows in the first, a worker
    idle between its steps in the second. `seconds` spans the reads, so the busy share is
    within a report interval's error of the truth."""
    out = {}
    for name, end in after.items():
        d = {k: end.get(k, 0) - before.get(name, {}).get(k, 0)
             for k in ("steps", "prefill_tokens", "decode_tokens", "preemptions", "step_us")}
        d["decode_tokens_per_step"] = d["decode_tokens"] / d["steps"] if d["steps"] else None
        d["wall_ms_per_step"] = seconds * 1e3 / d["steps"] if d["steps"] else None
        d["busy_ms_per_step"] = d["step_us"] / 1e3 / d["steps"] if d["steps"] else None
        d["busy_share"] = d["step_us"] / 1e6 / seconds  # time inside steps over the burst's wall time
        out[name] = d
    return out


def burst_at_once(cluster, texts, run_one, params, uid: str, burst: int, prompt_tokens: int, load) -> list:
    """Every request of the burst from its own thread at once; each entry (Timed, stream) or
    the exception its thread raised. The backlog stops once every request has ended."""
    results: list = [None] * burst

    def one(i: int) -> None:
        try:
            results[i] = run_one(cluster, texts.make(f"{uid}.{i}", prompt_tokens), params)
        except BaseException as exc:  # noqa: BLE001 - raised by the caller, after every thread ended
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,), name=f"burst-{i}", daemon=True) for i in range(burst)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        if load is not None:
            load.stop()
    return results


def summarize(results: list[tuple], a: str, b: str) -> dict:
    row: dict = {}
    timings = [t for t, _ in results]
    record_stat(row, "e2e_s", [t.finished - t.submitted for t in timings], column=False)
    row["makespan_s"] = max(t.finished for t in timings) - min(t.submitted for t in timings)
    picks, decisions = [], []
    for t, stream in results:
        d = stream.decision or {}
        pick = "split" if d.get("split") else ("whole:A" if d.get("chosen") == a else "whole:B")
        picks.append(pick)
        decisions.append({"pick": pick, "e2e_s": t.finished - t.submitted, "ttft_s": t.first_token - t.submitted,
                          "where_the_time_went": time_split(stream.metrics or {}), "reason": d.get("reason"),
                          "whole": {c["worker"]: c.get("score") for c in d.get("candidates") or []},
                          "split": {f"{s['prefill']}->{s['decode']}": s["score"]
                                    for s in d.get("split_candidates") or []}})
    row["picks"] = {p: picks.count(p) for p in ("whole:A", "whole:B", "split")}
    row["decisions"] = decisions
    return row


def time_split(metrics: dict) -> dict:
    """Where a request's time went, from its metrics: the queue and first token on the
    worker that prefilled it and, for a split, the handoff and the decode worker's queue."""
    out = {k: metrics.get(k) for k in ("queue_time_s", "time_to_first_token_s", "decode_tokens_per_s")}
    split = metrics.get("split")
    if split:
        decode = split.get("decode_metrics") or {}
        out.update({k: split.get(k) for k in ("tokens_on_prefill_worker", "reserved_after_ms", "handoff_ms",
                                               "write_ms", "transport")},
                   decode_queue_time_s=decode.get("queue_time_s"), decode_output_tokens=decode.get("output_tokens"),
                   decode_e2e_s=decode.get("e2e_s"), kv_tokens=split.get("kv_tokens"),
                   # What B restored from the moved pages, and what it computed again: a split
                   # whose pages B cannot use pays the transfer AND a CPU prefill.
                   decode_restored_tokens=decode.get("cached_prompt_tokens"),
                   decode_computed_tokens=(decode["prompt_tokens"] - decode["cached_prompt_tokens"]
                                           if "prompt_tokens" in decode and "cached_prompt_tokens" in decode else None))
    return out


def restored_computed(timing: dict) -> str:
    restored, computed = timing.get("decode_restored_tokens"), timing.get("decode_computed_tokens")
    return "—" if restored is None or computed is None else f"{restored} / {computed}"


def render_burst(burst: dict, a: str, b: str) -> list[str]:
    out = [f"## A burst: {burst['burst']} requests at once ({burst['prompt_tokens']}-token prompts, "
           f"{burst['max_tokens']}-token answers), A = {a} holding {burst['backlog']} long answers", "",
           "| router | e2e s median | mean ± std | makespan s | whole:A / whole:B / split |", "|---|---|---|---|---|"]
    for policy, r in burst["policies"].items():
        p = r["picks"]
        label = "every request split (by hand)" if policy == "split" else policy
        out.append(f"| {label} | {r['e2e_s_median']:.3f} | {r['e2e_s_mean']:.3f} ± {r['e2e_s_std']:.3f} | "
                   f"{r['makespan_s']:.3f} | {p['whole:A']} / {p['whole:B']} / {p['split']} |")
    out += ["", f"cost+split ÷ cost: mean e2e {burst['mean_e2e_ratio']:.3f}, makespan {burst['makespan_ratio']:.3f}; "
            f"every request split by hand ÷ cost: mean e2e {burst['all_split_mean_e2e_ratio']:.3f}.",
            "", "Decisions under cost+split, one per request (scores in s):", "",
            f"| # | pick | e2e s | first token s | whole on {a} | whole on {b} | {a} → {b} | {b} → {a} "
            f"| split: tokens restored / computed on {b} |",
            "|---|---|---|---|---|---|---|---|---|"]

    def cell(v):
        return "—" if v is None else f"{v:.3f}"

    for i, d in enumerate(burst["policies"]["cost+split"]["decisions"]):
        out.append(f"| {i} | {d['pick']} | {d['e2e_s']:.3f} | {d['ttft_s']:.3f} | {cell(d['whole'].get(a))} "
                   f"| {cell(d['whole'].get(b))} "
                   f"| {cell(d['split'].get(f'{a}->{b}'))} | {cell(d['split'].get(f'{b}->{a}'))} "
                   f"| {restored_computed(d.get('where_the_time_went') or {})} |")
    for policy in ("cost+split", "split"):
        steps = (burst["policies"][policy].get("engine_steps") or {}).get(b)
        if not steps or not steps["steps"]:
            continue
        out += ["", f"{b} over the {policy} burst: {steps['steps']} steps, {steps['decode_tokens']} decode and "
                f"{steps['prefill_tokens']} prompt tokens, {steps['preemptions']} preemptions; "
                f"{steps['decode_tokens_per_step']:.2f} decode tokens a step, {steps['busy_ms_per_step']:.1f} ms "
                f"inside a step and {steps['wall_ms_per_step']:.1f} ms of wall time a step (inside steps "
                f"{steps['busy_share']:.0%} of the burst)."]
        cores = burst["policies"][policy].get("cores_busy") or {}
        if cores:
            held = ", ".join(f"{k} {v:.1f}" for k, v in cores.items() if k not in ("host_cores", "busiest_threads"))
            threads = "; ".join(f"{k}: " + ", ".join(f"{v:.2f}" for v in t)
                                for k, t in (cores.get("busiest_threads") or {}).items())
            out += ["", f"Cores kept busy over the {policy} burst, on average ({cores['host_cores']} on the host): "
                    f"{held}. Busiest threads, in cores: {threads}."]
    rates = (burst["policies"]["cost+split"].get("rates_after") or {}).get(b) or {}
    if rates.get("decode_tps"):
        points = ", ".join(f"{n} rows {float(r):.1f}" for n, r in sorted(rates["decode_tps"].items(),
                                                                           key=lambda kv: int(kv[0])))
        out += ["", f"{b}'s decode rate after the split burst, as it measured its own steps (tokens/s, all rows "
                f"together, at {rates.get('calibration_context') or '?'} tokens of context a row): {points}; "
                f"context term {1e6 * float(rates.get('context_s') or 0.0):.2f} µs a step per token beyond that."]
    return out
