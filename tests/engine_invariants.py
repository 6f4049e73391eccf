"""Page, queue and snapshot bookkeeping every engine state must satisfy, with or without
the prefix cache and single-flight (shared by test_engine.py and test_prefix_cache.py).

Page ownership is recomputed from scratch here (block tables of live requests, plus one
reference per page the prefix index holds) and compared with the pool's counts, so a
leaked, double-freed or wrongly shared page fails whatever code path caused it.
"""

from __future__ import annotations

import json
from collections import Counter

from minivllm.engine.engine import LLMEngine
from minivllm.engine.request import Status

FINISH_REASONS = {"stop", "length", "abort", "error"}


def requests(engine: LLMEngine) -> list:
    """Read-only views of every request the engine holds."""
    return [engine.request_state(r) for r in engine.request_ids()]


def cached_pages(engine: LLMEngine) -> set[int]:
    cache = engine.kv_ownership()["cache"]
    blocks, by_page = cache["blocks"], cache["pages"]
    pages = set(by_page)
    assert len(pages) == len(blocks), "index maps and page maps disagree"
    for key, (parent_key, page, n_tokens) in blocks.items():
        assert by_page[page] == key
        assert n_tokens == engine.pool.page_size
        # A chain is never cut in the middle: every cached block's parent is cached too
        # (eviction takes leaves only).
        assert parent_key == 0 or parent_key in blocks, f"orphan block on page {page}"
    return pages


def check_invariants(engine: LLMEngine) -> None:
    pool = engine.pool
    everyone = requests(engine)
    live = [r for r in everyone if r.status != Status.FINISHED]
    for r in everyone:
        if r.status == Status.FINISHED:
            assert r.block_table == [], f"finished {r.id} still holds pages {r.block_table}"
            assert r.finish_reason in FINISH_REASONS
    held = Counter(p for r in live for p in r.block_table)
    cached = cached_pages(engine)
    for r in live:
        assert len(set(r.block_table)) == len(r.block_table), f"{r.id} holds a page twice"
    # Pages reserved for another worker's K/V (a split request's decode half) until it lands.
    landing = Counter(p for pages in engine.kv_ownership()["landing"].values() for p in pages)
    owners = held + Counter(cached) + landing
    if engine.graph_runner is not None:  # CUDA graphs keep one scratch page for padding rows
        owners[engine.graph_runner.scratch_page] += 1
    # Only cached pages may be shared between requests.
    assert all(n == 1 or p in cached for p, n in held.items()), f"uncached pages held twice: {held}"
    assert all(r >= 0 for r in pool.refcount), "negative refcount"
    for p in range(pool.num_pages):
        assert pool.refcount[p] == owners.get(p, 0), (
            f"page {p}: refcount {pool.refcount[p]}, holders {owners.get(p, 0)}"
        )
    assert len(owners) == pool.num_pages - pool.num_free
    idle = {p for p in cached if p not in held and p not in landing}
    assert set(engine.kv_ownership()["cache"]["idle"]) == idle, (
        "the index's idle list disagrees with who holds its pages"
    )
    assert engine.kv_ownership()["requests"] == {r.id: r.block_table for r in live}
    running = [engine.request_state(r) for r in engine.progress()]
    assert len(running) <= engine.config.max_active_requests
    for r in live:
        if r in running:
            assert r.status == Status.RUNNING
            assert pool.pages_for(r.num_computed) <= len(r.block_table)
            assert r.num_computed < r.num_tokens or not r.output_ids, "a running request computed its pending token"
        else:
            assert r.status in (Status.WAITING, Status.PREEMPTED) and r.block_table == [] and r.num_computed == 0
    flights = engine.flights
    if flights is not None:
        members = set(flights.flight_of) | flights.released
        assert members == {r.id for r in live}, "single-flight tracks exactly the live requests"
        for r in live:
            if flights.waiting_on(r.id) is not None:
                assert r not in running, f"follower {r.id} was admitted before its flight released it"

    snap = engine.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    kv = snap["kv"]
    assert kv["free_pages"] == pool.num_free == kv["page_states"].count("free")
    assert kv["page_states"].count("cached-idle") == len(idle) == snap["prefix_cache"]["idle_pages"]
    assert kv["available_pages"] == pool.num_free + len(idle)
    assert kv["used_pages"] == kv["total_pages"] - kv["free_pages"]
    assert kv["ref_counts"] == [owners.get(p, 0) for p in range(pool.num_pages)]
    q = snap["queues"]
    queued = [d["id"] for name in ("waiting", "preempted", "running") for d in q[name]]
    assert len(queued) == len(set(queued)) and set(queued) == {r.id for r in live}
    for name in ("waiting", "preempted", "running"):
        for d in q[name]:
            assert d["status"] == name and d["pages"] == len(engine.request_state(d["id"]).block_table)
    c = snap["counters"]
    assert c["requests_finished"] == sum(c[f"finished_{k}"] for k in ("stop", "length", "abort", "error"))


def free_equals_total(engine: LLMEngine) -> None:
    """An idle engine holds no page: every page is free or cached-idle, and once the
    prefix cache lets go of its idle pages, all are free with refcount 0."""
    check_invariants(engine)
    snap = engine.snapshot()["kv"]
    reserved = [engine.graph_runner.scratch_page] if engine.graph_runner is not None else []
    assert snap["available_pages"] + len(reserved) == snap["total_pages"] == engine.pool.num_pages, snap
    assert set(snap["page_states"]) - {"free", "cached-idle"} <= ({"owned"} if reserved else set()), snap["page_states"]
    engine.clear_prefix_cache()
    assert engine.pool.num_free + len(reserved) == engine.pool.num_pages
    assert all(r == (p in reserved) for p, r in enumerate(engine.pool.refcount))
