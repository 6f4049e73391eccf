"""Cluster snapshot -> one small, comparable view model per panel.

Pure functions over `Cluster.snapshot()` (minivllm's public contract): no widgets here, so
they are tested without a browser, and the publisher sends a panel only when its view
model changed. Each view model is plain data; equal data means nothing to send.
"""

from __future__ import annotations

from minivllm_widgets.page_grid import counts_from_codes, page_codes


def queues_view(snapshot: dict) -> dict:
    """Per worker: waiting / running / preempted requests with phase and progress.

    A worker sends its engine snapshot every 0.25 s, so the latest one can still list a
    request whose last token the controller already has. The controller's in-flight ledger
    (`in_flight`, updated on every terminal event) is the truth: a request the snapshot
    lists but the ledger no longer holds is shown as finished, never as running."""
    out = {}
    for w in snapshot["workers"]:
        snap = w.get("snapshot")
        open_ids = None if "in_flight" not in w else {f["request_id"] for f in w["in_flight"]}
        rows = []
        if snap is not None:
            for queue in ("running", "waiting", "preempted"):
                for r in snap["queues"][queue]:
                    finished = open_ids is not None and r["id"] not in open_ids
                    prompt = max(1, r["prompt_tokens"])
                    progress = (min(r["computed_tokens"], prompt) / prompt if r["phase"] == "prefill"
                                else r["output_tokens"] / max(1, r["max_tokens"]))
                    rows.append({"id": r["id"], "queue": "finished" if finished else queue,
                                 "phase": "done" if finished else r["phase"],
                                 "progress": 1.0 if finished else round(progress, 2),
                                 "prompt_tokens": r["prompt_tokens"], "output_tokens": r["output_tokens"],
                                 "restored_tokens": r["restored_tokens"], "flight": r.get("flight")})
        node = (w.get("location") or {}).get("node_ip")  # Ray workers: the node they run on
        out[w["name"]] = {
            "state": w["state"],
            "device": w["device"] + (f" on {node}" if node else ""),
            "requests": rows,
        }
    return out


def kv_view(snapshot: dict) -> dict:
    """Per worker: one byte per page (page_grid.page_codes) plus counts per state."""
    out = {}
    for w in snapshot["workers"]:
        snap = w.get("snapshot")
        if snap is None:
            out[w["name"]] = None
            continue
        kv, cache = snap["kv"], snap["prefix_cache"]
        codes = page_codes(kv["page_states"], kv["ref_counts"])
        out[w["name"]] = {
            "codes": codes,
            "owners": page_owners(snap),
            "counts": counts_from_codes(codes),
            "total": kv["total_pages"],
            "page_size": kv["page_size"],
            "hits": cache["hits"],
            "lookups": cache["lookups"],
            "restored_tokens": cache["restored_tokens"],
            "flights": len(cache["flights"]),
            "state": w.get("state"),
        }
    return out


def page_owners(engine_snapshot: dict) -> dict[int, list[str]]:
    """Page id -> the ids of the requests whose block tables hold it (the map's hover)."""
    owners: dict[int, list[str]] = {}
    for queue in ("running", "waiting", "preempted"):
        for r in engine_snapshot["queues"][queue]:
            for page in r.get("block_table") or ():
                owners.setdefault(int(page), []).append(r["id"])
    return owners


def headline_view(snapshot: dict, throughput: dict) -> tuple:
    """The dashboard's first row, per worker: state, running and waiting requests, the
    latest decode tok/s (the throughput chart's newest point), KV use and prefix hits."""
    rows = []
    for w in snapshot["workers"]:
        snap = w.get("snapshot")
        series = throughput.get(w["name"]) or []
        rate = round(series[-1][1], 1) if series else None
        if snap is None:
            rows.append((w["name"], w["state"], None, None, rate, None, None))
            continue
        q, kv, cache = snap["queues"], snap["kv"], snap["prefix_cache"]
        used = kv["used_pages"] / kv["total_pages"] if kv["total_pages"] else 0.0
        rows.append((w["name"], w["state"], len(q["running"]), len(q["waiting"]) + len(q["preempted"]), rate,
                     round(used, 3), (cache["hits"], cache["lookups"])))
    return tuple(rows)


def router_view(snapshot: dict, last: int = 12) -> dict:
    """The latest decisions: each candidate's score split into prefill and decode terms."""
    rows = []
    for d in snapshot["router"]["decisions"][-last:]:
        rows.append({"request_id": d["request_id"], "policy": d["policy"], "reason": d["reason"], "chosen": d["chosen"],
                     "candidates": [{"worker": c["worker"], "healthy": c["healthy"], "active": c["active"],
                                     "queued": c["queued"], "cached": c["cached_tokens"],
                                     "prefill_s": c.get("prefill_s"), "decode_s": c.get("decode_s"),
                                     "finish_s": c.get("finish_s"), "score": c.get("score")}
                                    for c in d["candidates"]],
                     # "prefill here, decode there" (cost+split), and the pair it chose if any
                     "split": d.get("split"), "splits": [dict(c) for c in d.get("split_candidates", [])]})
    return {"policy": snapshot["router"]["policy"], "decisions": rows}


def speculative_view(snapshot: dict) -> dict:
    out = {}
    for w in snapshot["workers"]:
        snap = w.get("snapshot")
        spec = snap["speculative"] if snap is not None else {"enabled": False}
        if not spec.get("enabled"):
            out[w["name"]] = None
            continue
        out[w["name"]] = {"acceptance_rate": spec["acceptance_rate"], "proposed": spec["proposed"],
                          "accepted": spec["accepted"], "histogram": dict(spec["draft_length_histogram"]),
                          "recent": [(r["proposed"], r["accepted"]) for r in spec["recent_rounds"][-64:]]}
    return out


class ThroughputTracker:
    """Tokens/s per worker over time, from the engines' cumulative counters, and step
    latency (the last step's wall time: what every running request waited for its next
    token).

    Workers send a snapshot every 0.25 s while the dashboard polls up to 20 times a second,
    so most polls see unchanged counters: differencing consecutive polls would saw-tooth
    between 0 and spikes. Each rate is taken over a trailing window instead (`smooth_s`,
    from the oldest sample at least that old), which spans several snapshots."""

    def __init__(self, window: int = 600, smooth_s: float = 2.0):
        self.window = window
        self.smooth_s = smooth_s
        self._samples: dict[str, list[tuple[float, int, int]]] = {}  # (t, decode, prefill) within smooth_s
        self.series: dict[str, list[tuple[float, float, float]]] = {}  # (t, decode tok/s, prefill tok/s)
        self.step_ms: dict[str, list[tuple[float, float]]] = {}  # (t, last step's duration in ms)

    def update(self, snapshot: dict) -> dict:
        t = snapshot["time"]
        for w in snapshot["workers"]:
            snap = w.get("snapshot")
            if snap is None:
                continue
            c = snap["counters"]
            decode, prefill = c["decode_tokens"], c["prefill_tokens"]
            samples = self._samples.setdefault(w["name"], [])
            prev = samples[-1] if samples else None
            step = snap.get("last_step") or {"index": 0}
            if step["index"] and (prev is None or decode != prev[1] or prefill != prev[2]):
                lat = self.step_ms.setdefault(w["name"], [])
                lat.append((t, 1000.0 * step["duration_s"]))
                del lat[:-self.window]
            if prev is not None and (t <= prev[0] or decode < prev[1]):
                if decode < prev[1]:  # the worker restarted (counters reset): start over
                    samples[:] = [(t, decode, prefill)]
                continue
            samples.append((t, decode, prefill))
            # the newest sample at least smooth_s old is the window's start; older ones go
            while len(samples) > 2 and t - samples[1][0] >= self.smooth_s:
                samples.pop(0)
            if len(samples) < 2:
                continue  # first sight
            t0, d0, p0 = samples[0]
            dt = t - t0
            series = self.series.setdefault(w["name"], [])
            series.append((t, (decode - d0) / dt, (prefill - p0) / dt))
            del series[:-self.window]
        return {name: list(s) for name, s in self.series.items()}
