"""The soak's checks: after the traffic, the server's ledger, engines, pages, counters and RSS
must show that nothing was lost or leaked (each check named in the result)."""

from __future__ import annotations

import time
from collections import Counter

from minivllm.reliability.workload import OUTCOMES, Record, SoakSettings


def get_snapshot(url: str, headers: dict) -> dict:
    import httpx

    r = httpx.get(url + "/v1/cluster/snapshot", params={"fresh": "true"}, headers=headers, timeout=60)
    r.raise_for_status()
    return r.json()


def server_idle(snap: dict) -> bool:
    req = snap.get("requests") or {}
    if req.get("open", 0):
        return False
    for w in snap.get("workers", []):
        if w.get("in_flight"):
            return False
        s = w.get("snapshot") or {}
        q, kv = s.get("queues") or {}, s.get("kv") or {}
        if q.get("waiting") or q.get("running") or q.get("preempted"):
            return False
        # reserved_pages: the engine's own (the CUDA graphs' scratch page), never a request's
        if kv and kv.get("available_pages", 0) + kv.get("reserved_pages", 0) != kv.get("total_pages"):
            return False
    return True


def wait_idle(url: str, headers: dict, timeout_s: float) -> tuple[dict, float]:
    """The fresh cluster snapshot once the server is idle (or the last one at the timeout), and the wait."""
    t0 = time.monotonic()
    while True:
        snap = get_snapshot(url, headers)
        if server_idle(snap) or time.monotonic() - t0 > timeout_s:
            return snap, time.monotonic() - t0
        time.sleep(0.5)


def ended_counts(ledger: dict | None) -> Counter:
    return Counter((ledger or {}).get("ended") or {})


def evaluate(records: list[Record], start: dict, final: dict, rss: dict, settings: SoakSettings,
             idle_wait_s: float, expect_server_rss: bool = True) -> list[dict]:
    checks: list[dict] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    by = Counter(r.outcome for r in records)
    http = [r for r in records if r.outcome == "http_error"]
    fivexx = [r for r in http if (r.status or 0) >= 500]
    four = [r for r in http if 400 <= (r.status or 0) < 500 and r.status != 429]
    check(
        "no_5xx",
        not fivexx,
        f"{len(fivexx)} responses >= 500" + (f"; first: {fivexx[0].status} {fivexx[0].error}" if fivexx else ""),
    )
    for name, outcome in (("no_transport_errors", "transport_error"), ("no_protocol_errors", "protocol_error"),
                          ("no_stream_errors", "stream_error")):
        bad = [r for r in records if r.outcome == outcome]
        check(name, not bad, f"{len(bad)}" + (f"; first (#{bad[0].index}): {bad[0].error}" if bad else ""))
    check("no_unexpected_4xx", not four, f"{len(four)} (429s: {sum(r.status == 429 for r in http)})"
          + (f"; first: {four[0].status} {four[0].error}" if four else ""))
    anomalies = []
    for r in records:
        if r.outcome != "finished" or r.completion_tokens is None:
            continue
        if r.completion_tokens > r.max_tokens:
            anomalies.append(f"#{r.index}: {r.completion_tokens} tokens > max_tokens {r.max_tokens}")
        elif r.finish_reason == "length" and r.completion_tokens != r.max_tokens:
            anomalies.append(f"#{r.index}: length after {r.completion_tokens} of {r.max_tokens} tokens")
        elif r.ignore_eos and not r.has_stop and r.finish_reason != "length":
            anomalies.append(f"#{r.index}: ignore_eos without stop strings ended {r.finish_reason!r}")
    check("client_anomalies", not anomalies, f"{len(anomalies)}" + (f"; {anomalies[:3]}" if anomalies else ""))
    once = [r for r in records if r.endings != 1 or r.outcome not in OUTCOMES]
    check("every_request_ended_once", not once and len(records) == len({r.index for r in records}),
          f"{len(records)} requests sent (of {settings.requests} planned), {len(once)} not ended exactly once")

    ledger, ledger0 = final.get("requests"), start.get("requests") or {}
    check("ledger_present", ledger is not None, "" if ledger else "the snapshot has no 'requests' ledger")
    ledger = ledger or {}
    ended = ended_counts(ledger) - ended_counts(ledger0)
    submitted = ledger.get("submitted", 0) - ledger0.get("submitted", 0)
    check("ledger_no_open", ledger.get("open") == 0, f"open={ledger.get('open')} ids={ledger.get('open_ids')} "
          f"(idle wait {idle_wait_s:.1f} s)")
    check("ledger_no_duplicate_terminals", ledger.get("duplicate_terminals") == 0,
          f"duplicate_terminals={ledger.get('duplicate_terminals')}")
    check(
        "ledger_balanced",
        ledger.get("submitted") == sum(ended_counts(ledger).values()),
        f"submitted={ledger.get('submitted')} sum(ended)={sum(ended_counts(ledger).values())} "
        f"ended={dict(ended_counts(ledger))}",
    )
    check("ledger_no_errors", ended.get("error", 0) == 0, f"ended error={ended.get('error', 0)}")

    workers = final.get("workers") or []
    not_ready = [w["name"] for w in workers if w.get("state") != "ready"]
    check("workers_ready", workers and not not_ready, f"{len(workers)} workers; not ready: {not_ready}")
    busy = {w["name"]: [f["request_id"] for f in w.get("in_flight") or []] for w in workers if w.get("in_flight")}
    check("workers_no_in_flight", not busy, f"{busy}" if busy else "")
    queues, pages, flights = {}, {}, {}
    for w in workers:
        s = w.get("snapshot") or {}
        q = s.get("queues") or {}
        left = {k: [x.get("id") for x in q.get(k) or []] for k in ("waiting", "preempted", "running") if q.get(k)}
        if left or not s:
            queues[w["name"]] = left or "no engine snapshot"
        kv = s.get("kv") or {}
        states = Counter(kv.get("page_states") or [])
        held = {k: v for k, v in states.items() if k not in ("free", "cached-idle")}
        reserved = kv.get("reserved_pages", 0)  # the CUDA graphs' scratch page: owned by the engine itself
        if not states:
            pages[w["name"]] = "no page states"
        elif sum(held.values()) > reserved or set(held) - {"owned"}:
            pages[w["name"]] = f"{held} (reserved_pages {reserved})"
        pc = s.get("prefix_cache") or {}
        if pc.get("flights"):
            flights[w["name"]] = pc["flights"]
    check("engines_idle", not queues, f"{queues}" if queues else "")
    check("no_leaked_pages", not pages, f"{pages}" if pages else
          "every page free or cached-idle (besides the engine's reserved pages)")
    check("no_flights", not flights, f"{flights}" if flights else "")
    unbalanced = {}
    for w in workers:
        c = w.get("counters") or {}
        e = (w.get("snapshot") or {}).get("counters") or {}
        if c.get("routed") != c.get("finished", 0) + c.get("rejected", 0):
            unbalanced[w["name"]] = (
                f"routed {c.get('routed')} != finished {c.get('finished')} + rejected {c.get('rejected')}"
            )
        elif e.get("requests_submitted") != e.get("requests_finished"):
            unbalanced[w["name"]] = (f"engine requests_submitted {e.get('requests_submitted')} != "
                                     f"requests_finished {e.get('requests_finished')}")
    routed = sum((w.get("counters") or {}).get("routed", 0) for w in workers) - \
        sum((w.get("counters") or {}).get("routed", 0) for w in start.get("workers") or [])
    if ledger and routed != submitted:
        unbalanced["cluster"] = f"workers routed {routed} != ledger submitted {submitted}"
    check("counters_balanced", not unbalanced, f"{unbalanced}" if unbalanced else
          f"per worker routed == finished + rejected, engine submitted == finished; routed {routed}")

    finished = by.get("finished", 0)
    answered = sum(1 for r in records if r.status == 200)  # the server routed these
    sent = len(records)
    abandoned = by.get("cancelled", 0) + by.get("disconnected", 0)
    server_done = ended.get("stop", 0) + ended.get("length", 0)
    problems = []
    if finished > server_done:
        problems.append(f"client finished {finished} > server stop+length {server_done}")
    if ended.get("abort", 0) > abandoned:
        problems.append(f"server abort {ended.get('abort', 0)} > client cancelled+disconnected {abandoned}")
    if not answered <= submitted <= sent:
        problems.append(f"not answered {answered} <= server submitted {submitted} <= sent {sent}")
    check("client_vs_server", not problems,
          "; ".join(problems) or f"finished {finished} <= stop+length {server_done}; abort {ended.get('abort', 0)} <= "
          f"cancelled+disconnected {abandoned}; answered {answered} <= submitted {submitted} <= sent {sent}")

    unsampled = {k: v["samples"] for k, v in rss.items() if v["samples"] < 2}
    expected = int(expect_server_rss) + len(workers)
    check("rss_sampled", len(rss) >= expected and not unsampled,
          f"{len(rss)} processes sampled (expected >= {expected}); too few samples: {unsampled}")
    if settings.max_rss_growth is not None:
        grown = {k: round(v["ratio"], 3) for k, v in rss.items()
                 if (k == "server" or k.startswith("worker")) and v["ratio"] > settings.max_rss_growth}
        check("rss_growth", not grown, f"last/first-quarter RSS over {settings.max_rss_growth}: {grown}" if grown
              else f"every ratio <= {settings.max_rss_growth}")
    return checks
