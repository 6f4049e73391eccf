"""`minivllm bench soak`: thousands of mixed, bursty, partly abandoned requests against a
real `minivllm serve`, then proof that the server lost nothing and leaked nothing.

A reliability tool, not a benchmark: it measures no speed worth comparing, it checks
invariants. So its code lives here, in minivllm/reliability/ (workload.py: the settings
and the seeded requests; client.py: the asyncio client; rss.py: memory sampling;
checks.py: the invariants; report.py: the result files), and only its command stays
`minivllm bench soak`, registered like a benchmark driver (reliability/driver.py), because
`bench all` runs it, its result files sit with the benchmarks' in benchmarks/results/, and
every runbook and CI job already calls it by that name.

The server is a real `python -m minivllm serve` subprocess (two `cpu:1` workers by
default), or an already-running one (`url=`). The client is one asyncio loop with an
httpx client that keeps no idle connections, so every request has its own TCP
connection and a cancel or a disconnect really closes it.

Workload (all of it drawn from `seed`): prompt bodies cut from the repository's text
(data/prompts.json, data/speculative/*.txt) at a random token offset, 5..300 tokens
(half of them under 60), some starting with one of four shared preambles (prefix-cache
hits), some exact repeats of an earlier prompt, some sprinkled with non-ASCII words (a
streamed token may end mid-character), some sent as token ids; `max_tokens` 1..cap;
temperature 0 / 0.7 / 1.0 with random top_p, top_k, seed, penalties, stop strings and
ignore_eos; /v1/completions and /v1/chat/completions, streamed and not. Arrivals come in
bursts (`burst` requests at once), each followed by a wait until the client has nothing
in flight (`drain_to`) and an idle gap (`gap_s`) during which a Poisson trickle
(`trickle_rate` per second) arrives. With `max_duration_s` no burst or trickle request
starts after that many seconds: the soak then covers the requests sent so far (the
result says how many of the planned ones).

Abandonment: a `cancel_fraction` of the requests are cancelled: the asyncio task doing
the request is cancelled, which closes its connection. A fifth of the cancels come within
30 ms of sending (often before the request is even routed); the rest at a random fraction
(0..1.3) of the recent median end-to-end latency after sending, or, for half of the
streamed ones, at a random fraction of the recent median decode time after the first
chunk (mid-stream). A `disconnect_fraction` of the requests are streamed and close the
stream after a random number of chunks (1..max_tokens). A request that ends before its
cancel or disconnect is simply "finished".

Every request ends exactly once on the client side, as one of:
    finished         200 with finish_reason stop/length (and, streamed, `data: [DONE]`)
    http_error       a non-200 status (status and body kept)
    stream_error     an error chunk inside a 200 stream
    cancelled        the client cancelled it (before or after the first byte)
    disconnected     the client closed the stream mid-way
    transport_error  httpx raised (connect/read error, timeout, reset)
    protocol_error   a malformed answer (a stream without [DONE] or finish_reason, bad JSON)

While it runs, a thread samples the RSS of the server process and of each of its child
processes (the workers) every second (psutil). At the end, once every client is done,
it waits until the server is idle and reads `/v1/cluster/snapshot?fresh=true`: the
request ledger (`requests`) and every worker's engine snapshot. The checks (each one
named in the result):

    no_5xx, no_transport_errors, no_protocol_errors, no_stream_errors, no_unexpected_4xx,
    client_anomalies (finish_reason vs max_tokens/ignore_eos), every_request_ended_once,
    ledger_present, ledger_no_open, ledger_no_duplicate_terminals, ledger_balanced
    (submitted == sum(ended)), ledger_no_errors, workers_ready, workers_no_in_flight,
    engines_idle (no waiting/preempted/running), no_leaked_pages (every page free or
    cached-idle, besides `kv.reserved_pages`, the CUDA graphs' scratch page), no_flights,
    counters_balanced (per worker routed == finished + rejected, engine submitted ==
    finished, routed == ledger submitted), client_vs_server (finished <= server stop+length, server
    abort <= cancelled+disconnected, answered <= submitted <= sent), rss_sampled,
    with `max_rss_growth` rss_growth (last-quarter / first-quarter mean RSS per process),
    and, for a server it started, server_clean_exit (exit code 0 after Ctrl-C, no worker
    process left behind).

Results: benchmarks/results/soak-<tag>-<stamp>.json (provenance, settings, counts,
latency and throughput, RSS summary and a coarse series, checks, the failed requests)
and .md. `run()` returns the result dict; the CLI exits non-zero when a check fails.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from minivllm.bench.common import percentile, provenance
from minivllm.bench.server_process import ServerProcess, serve_supports
from minivllm.reliability.checks import ended_counts, evaluate, get_snapshot, wait_idle
from minivllm.reliability.client import drive
from minivllm.reliability.report import device_tag, print_summary, write_result
from minivllm.reliability.rss import RssSampler
from minivllm.reliability.workload import (
    DEFAULT_DEVICES,
    OUTCOMES,
    PromptMaker,
    SoakSettings,
    make_plans,
    make_schedule,
)


def run(model: str = "smollm2-135m", devices: list[str] | None = None, *, url: str | None = None,
        settings: SoakSettings | None = None, max_model_len: int | None = 1024, page_size: int | None = None,
        max_active_requests: int = 8, router: str | None = None, api_key: str | None = None,
        serve_args: list[str] | None = None, out_dir: str | Path | None = None, tag: str | None = None,
        ready_timeout_s: float = 900.0, progress: bool = True, write: bool = True) -> dict:
    """Start the server (unless `url`), drive the soak, check, write the result files; returns the result
    (`result["ok"]`, `result["checks"]`, ...)."""
    import httpx

    from minivllm.bench.results import RESULTS_DIR

    settings = settings or SoakSettings()
    devices_given = bool(devices)
    devices = list(devices or DEFAULT_DEVICES)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t_wall = time.perf_counter()
    server = None
    log_dir = None
    serve_cmd = None
    start_s = None
    model_path = None
    try:
        from minivllm.models import resolve_model

        model_path = resolve_model(model, progress=False)
    except Exception as exc:  # noqa: BLE001 - a remote server's model need not be here
        if url is None:
            raise
        print(f"soak: model {model!r} is not available here ({exc}); prompts sized by words", flush=True)

    if url is None:
        from minivllm.serving.http_server import free_port

        port = free_port()
        serve_cmd = ["--model", str(model), "--port", str(port), "--max-active-requests", str(max_active_requests)]
        for d in devices:
            serve_cmd += ["--inference-device", d]
        if max_model_len:
            serve_cmd += ["--max-model-len", str(max_model_len)]
        if page_size:
            serve_cmd += ["--page-size", str(page_size)]
        if router:
            serve_cmd += ["--router", router]
        if api_key:
            serve_cmd += ["--api-key", api_key]
        if serve_supports("--max-concurrent-requests"):
            serve_cmd += ["--max-concurrent-requests", "512"]
        serve_cmd += list(serve_args or [])
        if progress:
            print("soak: starting minivllm serve " + " ".join(serve_cmd), flush=True)
        t = time.perf_counter()
        log_dir = tempfile.mkdtemp(prefix="minivllm-soak-")
        server = ServerProcess(serve_cmd, port, Path(log_dir) / "serve.log").start(ready_timeout_s)
        start_s = round(time.perf_counter() - t, 1)
        url = server.url
        worker_pids, server_pid = server.worker_pids, server.proc.pid
    else:
        url = url.rstrip("/")
        h = httpx.get(url + "/health", timeout=30).json()
        worker_pids = {w["pid"]: w["name"] for w in h.get("workers", []) if w.get("pid")}
        server_pid = None
        try:  # a local server: the workers' parent
            import psutil

            parents = {psutil.Process(pid).ppid() for pid in worker_pids}
            server_pid = parents.pop() if len(parents) == 1 else None
        except Exception:  # noqa: BLE001
            pass

    sampler = None
    try:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()
        served = models["data"][0]["id"]
        tokenizer = None
        if model_path is not None:
            from minivllm.gguf.tokenizer import Tokenizer

            tokenizer = Tokenizer.from_gguf(model_path)
        start_snap = get_snapshot(url, headers)
        if server is None and not devices_given:
            devices = [f"{w['device']}:{w['threads']}" if w.get("threads") and str(w.get("device")).startswith("cpu")
                       else str(w.get("device")) for w in start_snap.get("workers") or []] or devices
        limit = (
            (start_snap["workers"][0]["snapshot"] or {}).get("engine", {}).get("max_model_len")
            if start_snap.get("workers")
            else None
        )
        if limit and settings.max_prompt_tokens + settings.max_new_tokens + 80 > limit:
            settings.max_prompt_tokens = max(settings.min_prompt_tokens, limit - settings.max_new_tokens - 80)
            print(f"soak: max_model_len {limit}: prompts capped at {settings.max_prompt_tokens} tokens", flush=True)
        maker = PromptMaker(tokenizer, settings.seed)
        plans = make_plans(settings, maker, served)
        schedule = make_schedule(settings, len(plans))
        sampler = RssSampler(server_pid, worker_pids).start()
        if progress:
            print(
                f"soak: {len(plans)} requests against {url} in {sum(p[0] == 'burst' for p in schedule)} bursts",
                flush=True,
            )
        records, t0, t1 = asyncio.run(drive(url, plans, schedule, settings, api_key=api_key, progress=progress))
        final, idle_wait = wait_idle(url, headers, settings.idle_timeout_s)
        sampler.stop()
        rss = sampler.summary(t0, t1)
        checks = evaluate(records, start_snap, final, rss, settings, idle_wait, server_pid is not None)
        if sampler.error:
            checks.append({"name": "rss_sampler_errors", "ok": False, "detail": sampler.error})
    finally:
        if sampler is not None:
            sampler.stop()
        exit_code = server.stop() if server is not None else None

    result = _result(
        model,
        model_path,
        devices,
        settings,
        serve_cmd,
        url,
        start_s,
        plans,
        records,
        t0,
        t1,
        start_snap,
        final,
        idle_wait,
        rss,
        sampler,
        checks,
        max_model_len,
        max_active_requests,
        time.perf_counter() - t_wall,
        provenance,
    )
    result["server_exit_code"] = exit_code
    if server is not None:
        result["checks"].append({"name": "server_clean_exit", "ok": exit_code == 0 and not server.orphans,
                                 "detail": f"exit code {exit_code} after Ctrl-C; worker processes left behind: "
                                           f"{server.orphans or 'none'}"})
        result["ok"] = all(c["ok"] for c in result["checks"])
        if result["ok"]:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            result["server_log"] = str(server.log_path)
            result["server_log_tail"] = server.log_tail(60)
    if write:
        label = Path(model).stem if str(model).endswith(".gguf") or "/" in str(model) else str(model)
        name = f"soak-{tag or device_tag(devices) + '-' + label}"
        json_path, md_path = write_result(result, Path(out_dir) if out_dir else RESULTS_DIR, name)
        result["files"] = [str(json_path), str(md_path)]
    if progress:
        print_summary(result)
    return result


def _result(model, model_path, devices, settings, serve_cmd, url, start_s, plans, records, t0, t1, start_snap, final,
            idle_wait, rss, sampler, checks, max_model_len, max_active_requests, wall_s, provenance) -> dict:
    from minivllm.models.cache import sha256_file

    by = Counter(r.outcome for r in records)
    fin = [r for r in records if r.outcome == "finished"]
    e2e = [r.t_end - r.t_start for r in fin]
    ttft = [r.t_first - r.t_start for r in fin if r.stream and r.t_first is not None]
    load_s = max(1e-9, t1 - t0)
    tokens = sum(r.completion_tokens or 0 for r in fin)
    counters = {}
    for snap, sign in ((final, 1), (start_snap, -1)):
        for w in snap.get("workers") or []:
            for k, v in ((w.get("snapshot") or {}).get("counters") or {}).items():
                counters[k] = counters.get(k, 0) + sign * v
    summary = {
        "requests": len(records),
        "requests_planned": len(plans),
        "server_start_s": start_s,
        "load_s": round(load_s, 1),
        "wall_s": round(wall_s, 1),
        "idle_wait_s": round(idle_wait, 2),
        "requests_per_s": len(records) / load_s,
        "finished_per_s": len(fin) / load_s,
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "e2e_p50_stream_s": percentile([r.t_end - r.t_start for r in fin if r.stream], 50),
        "e2e_p50_nonstream_s": percentile([r.t_end - r.t_start for r in fin if not r.stream], 50),
        "ttft_p50_stream_s": percentile(ttft, 50),
        "ttft_p99_stream_s": percentile(ttft, 99),
        "finished_completion_tokens": tokens,
        "finished_completion_tok_per_s": tokens / load_s,
        "engine_decode_tokens": counters.get("decode_tokens"),
        "engine_prefill_tokens": counters.get("prefill_tokens"),
        "engine_decode_tok_per_s": (counters.get("decode_tokens") or 0) / load_s,
        "engine_prefill_tok_per_s": (counters.get("prefill_tokens") or 0) / load_s,
        "engine_preemptions": counters.get("preemptions"),
        "prompt_tokens_min": min((r.prompt_tokens for r in records if r.prompt_tokens), default=None),
        "prompt_tokens_max": max((r.prompt_tokens for r in records if r.prompt_tokens), default=None),
    }
    ledger, ledger0 = final.get("requests") or {}, start_snap.get("requests") or {}
    ended = dict(ended_counts(ledger) - ended_counts(ledger0))
    per_worker = {}
    for w in final.get("workers") or []:
        s = w.get("snapshot") or {}
        kv, pc = s.get("kv") or {}, s.get("prefix_cache") or {}
        per_worker[w["name"]] = {
            "state": w.get("state"),
            "counters": w.get("counters"),
            "engine_counters": s.get("counters"),
            "page_states": dict(Counter(kv.get("page_states") or [])),
            "total_pages": kv.get("total_pages"),
            "available_pages": kv.get("available_pages"),
            "prefix_cache": {
                k: pc.get(k)
                for k in ("cached_pages", "idle_pages", "in_use_pages", "hits", "lookups", "hit_rate", "evicted_pages")
            },
        }
    routed = Counter(r.worker for r in fin if r.worker)
    failures = [asdict(r) for r in records
                if r.outcome in ("http_error", "stream_error", "transport_error", "protocol_error")]
    notes = (
        f"{len(records)} requests against `minivllm serve` ({', '.join(devices)}; {model}); "
        f"cancel {settings.cancel_fraction:.0%}, disconnect {settings.disconnect_fraction:.0%}, "
        f"max_tokens 1..{settings.max_new_tokens}, prompts {settings.min_prompt_tokens}..{settings.max_prompt_tokens} "
        f"tokens, bursts {settings.burst[0]}..{settings.burst[1]} with {settings.gap_s[0]}..{settings.gap_s[1]} s "
        f"gaps and a {settings.trickle_rate}/s trickle."
    )
    cfg = {"model": model, "devices": devices, "url": url, "serve_args": serve_cmd, "max_model_len": max_model_len,
           "max_active_requests": max_active_requests, **asdict(settings)}
    return {
        "benchmark": "soak",
        "provenance": provenance(
            _provenance_device(devices), sha256_file(Path(model_path)) if model_path else None, cfg
        ),
        "notes": notes,
        "ok": all(c["ok"] for c in checks),
        "checks": checks,
        "rows": [{"ending": k, "count": by.get(k, 0)} for k in OUTCOMES],
        "summary": summary,
        "client": {
            "by_outcome": {k: by.get(k, 0) for k in OUTCOMES},
            "by_outcome_streamed": dict(Counter(r.outcome for r in records if r.stream)),
            "by_outcome_chat": dict(Counter(r.outcome for r in records if r.endpoint == "chat")),
            "by_action": dict(Counter(r.action for r in records)),
            "action_x_outcome": {
                a: dict(Counter(r.outcome for r in records if r.action == a))
                for a in ("normal", "cancel", "disconnect")
            },
            "cancel_phase": dict(Counter(r.cancel_phase for r in records if r.outcome == "cancelled")),
            "cancel_mode_x_outcome": {
                m: dict(Counter(r.outcome for r, p in zip(records, plans) if p.cancel_mode == m))
                for m in ("early", "timed", "mid_stream")
            },
            "finish_reasons": dict(Counter(r.finish_reason for r in fin)),
            "finished_by_kind": {
                f"{e}/{'stream' if st else 'json'}": sum(1 for r in fin if r.endpoint == e and r.stream == st)
                for e in ("completions", "chat")
                for st in (False, True)
            },
            "finished_by_worker": dict(routed),
            "http_statuses": dict(Counter(str(r.status) for r in records if r.status is not None)),
        },
        "server": {
            "submitted": ledger.get("submitted", 0) - ledger0.get("submitted", 0),
            "ended": ended,
            "open": ledger.get("open"),
            "open_ids": ledger.get("open_ids"),
            "duplicate_terminals": ledger.get("duplicate_terminals"),
            "ledger_final": ledger,
            "engine_counters_delta": counters,
            "per_worker": per_worker,
        },
        "rss": rss,
        "rss_series": sampler.series(t0) if sampler else {},
        "failures": failures,
    }


def _provenance_device(devices: list[str]) -> str:
    """The device named in the provenance: the first CUDA worker's, else the CPU."""
    for d in devices:
        if d.startswith("cuda"):
            return d.split("#")[0]
        if d == "gpu":
            return "cuda:0"
    return "cpu"


