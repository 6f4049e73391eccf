"""Prometheus metrics for `/metrics`, through prometheus_client.

Two kinds, kept apart on purpose:
- per-request latency histograms (TTFT, inter-token latency, e2e) and request/token
  counters, observed by the HTTP layer as each request streams;
- engine state (running/waiting requests, KV use, worker up) and the engines' own
  cumulative counters (prefix-cache queries/hits, speculative proposals/acceptances, how
  constrained tokens were drawn),
  read from the cluster snapshot at scrape time by a custom collector, so they are never
  stale and the engine needs no knowledge of Prometheus.

Each server has its own CollectorRegistry, so several servers (tests, notebooks) can live
in one process. Names follow Prometheus conventions with a `minivllm_` prefix and mirror
vLLM's metric set; `vllm_metrics.py` serves the same samples under vLLM's own names too.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from minivllm.serving.vllm_metrics import vllm_families

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


class ServingMetrics:
    def __init__(self, cluster):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("minivllm_time_to_first_token_seconds", "Arrival to first token, per request",
                              ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("minivllm_inter_token_latency_seconds", "Gap between consecutive token events",
                             ["worker"], buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minivllm_e2e_request_latency_seconds", "Arrival to last token, per request",
                             ["worker"], buckets=_E2E_BUCKETS, registry=r)
        self.requests = Counter("minivllm_requests", "Finished requests", ["worker", "finish_reason"], registry=r)
        self.prompt_tokens = Counter(
            "minivllm_prompt_tokens", "Prompt tokens of finished requests", ["worker"], registry=r
        )
        self.generation_tokens = Counter("minivllm_generation_tokens", "Generated tokens", ["worker"], registry=r)
        self.rejected = Counter("minivllm_rejected_requests", "Requests refused with a 4xx", ["reason"], registry=r)
        r.register(_EngineStateCollector(cluster))
        self.model_name = str(getattr(cluster, "model_name", "") or "")

    def render(self) -> bytes:
        """Our families, then the same samples under vLLM's names (vllm_metrics.py), from one
        collection (one cluster snapshot per scrape)."""
        families = list(self.registry.collect())
        return generate_latest(_Collected(families + list(vllm_families(families, self.model_name))))


class _Collected:
    """Already collected families, in the shape `generate_latest` reads."""

    def __init__(self, families):
        self.families = families

    def collect(self):
        return iter(self.families)


class _EngineStateCollector:
    """Gauges and engine counters straight from the cluster snapshot."""

    def __init__(self, cluster):
        self.cluster = cluster

    def describe(self):
        return []  # unchecked collector: families are only known at collect time

    def collect(self):
        up = GaugeMetricFamily("minivllm_worker_up", "1 when the worker is ready", labels=["worker"])
        running = GaugeMetricFamily("minivllm_num_requests_running", "Requests holding KV pages", labels=["worker"])
        waiting = GaugeMetricFamily("minivllm_num_requests_waiting", "Requests waiting or preempted", labels=["worker"])
        kv = GaugeMetricFamily("minivllm_kv_cache_usage_perc", "Fraction of KV pages in use (0-1)", labels=["worker"])
        queries = CounterMetricFamily(
            "minivllm_prefix_cache_queries", "Prefix-cache lookups at admission", labels=["worker"]
        )
        hits = CounterMetricFamily(
            "minivllm_prefix_cache_hits", "Lookups that restored at least one page", labels=["worker"]
        )
        proposed = CounterMetricFamily(
            "minivllm_spec_decode_num_draft_tokens", "Draft tokens proposed", labels=["worker"]
        )
        accepted = CounterMetricFamily(
            "minivllm_spec_decode_num_accepted_tokens", "Draft tokens accepted", labels=["worker"]
        )
        structured = CounterMetricFamily("minivllm_structured_draws", "Constrained tokens by how they were drawn: "
                                         "forced (no mask), masked_ahead, masked_at_draw, checked",
                                         labels=["worker", "how"])
        restarts = CounterMetricFamily("minivllm_worker_restarts", "Worker restarts: automatic (after a death or a "
                                       "hang; failed ones included) and by hand", labels=["worker", "kind"])
        snapshot = self.cluster.snapshot()
        ledger = snapshot["requests"]
        open_requests = GaugeMetricFamily(
            "minivllm_requests_open", "Accepted requests without their terminal event yet"
        )
        open_requests.add_metric([], ledger["open"])
        duplicates = CounterMetricFamily("minivllm_duplicate_terminal_events",
                                         "Terminal events for requests that had already ended (should stay 0)")
        duplicates.add_metric([], ledger["duplicate_terminals"])
        yield from (open_requests, duplicates, *split_families(snapshot.get("splits")))
        for w in snapshot["workers"]:
            name = w["name"]
            up.add_metric([name], 1.0 if w["state"] == "ready" else 0.0)
            restarts.add_metric([name, "automatic"], w["restarts"]["automatic"])
            restarts.add_metric([name, "manual"], w["restarts"]["manual"])
            snap = w["snapshot"]
            if snap is None:
                continue
            queues, pages = snap["queues"], snap["kv"]
            running.add_metric([name], len(queues["running"]))
            waiting.add_metric([name], len(queues["waiting"]) + len(queues["preempted"]))
            kv.add_metric([name], pages["used_pages"] / pages["total_pages"] if pages["total_pages"] else 0.0)
            queries.add_metric([name], snap["prefix_cache"]["lookups"])
            hits.add_metric([name], snap["prefix_cache"]["hits"])
            spec = snap["speculative"]
            proposed.add_metric([name], spec.get("proposed", 0))
            accepted.add_metric([name], spec.get("accepted", 0))
            for how, n in snap.get("structured", {}).items():
                structured.add_metric([name, how], n)
        yield from (up, restarts, running, waiting, kv, queries, hits, proposed, accepted, structured)


def split_families(splits: dict | None):
    """Split requests (prefill on one worker, decode on another; split_request.py): how
    they ended, and the K/V bytes they moved."""
    if not splits:
        return
    counters = splits["counters"]
    ended = CounterMetricFamily("minivllm_split_requests", "Split requests by outcome: finished, failed, "
                                "cancelled_in_prefill / _transfer / _decode", labels=["outcome"])
    for outcome in ("finished", "failed", "cancelled_in_prefill", "cancelled_in_transfer", "cancelled_in_decode"):
        ended.add_metric([outcome], counters.get(outcome, 0))
    moved = CounterMetricFamily("minivllm_split_kv_bytes", "K/V bytes moved between workers by split requests")
    moved.add_metric([], counters.get("kv_bytes", 0))
    yield from (ended, moved)
