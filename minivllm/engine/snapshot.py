"""`engine.snapshot()`: the engine's state as a plain JSON-serialisable dict.

This is a contract: the widgets, the router and the tests read only this. Schema
(all keys always present; times in seconds):

    {
      "schema": "minivllm.engine.snapshot/1",
      "engine": {model, architecture, device, activation_dtype, kv_dtype, kv_mode, page_size,
                 max_model_len, max_batched_tokens, max_active_requests, handoff_rows, policy},
      "queues": {
        "policy": str,
        "waiting":   [request],    # never scheduled yet
        "preempted": [request],    # evicted, waiting to be recomputed
        "running":   [request],    # holding pages; prefilling or decoding
      },
      "kv": {page_size, total_pages, free_pages, available_pages (free + cached-idle), used_pages, bytes,
             reserved_pages (the engine's own, e.g. the CUDA graphs' scratch page),
             "page_states": ["free" | "owned" | "cached-idle" | "cached-in-use" | "shared", ...],  # one per page
             "ref_counts": [int, ...]},          # one per page; the prefix cache holds one
      "prefix_cache": {enabled, publication, single_flight,
                       cached_pages, idle_pages, in_use_pages, cached_tokens,
                       lookups, hits, hit_rate, restored_tokens, published_pages,
                       duplicate_pages, evicted_pages,          # zeros when disabled
                       flights: [{leader, leader_phase, followers: [id], input_tokens}],
                       released: [id], flight_counters: {flights, followers, promotions,
                       released_followers}},
      "speculative": {enabled, draft_model, policy, tv_budget, shared_vocab,   # {enabled: false} without a draft
                      proposed, accepted, acceptance_rate, bonus_tokens, rounds, plain_steps,
                      draft_length_histogram: {k: rounds}, tv_mean, tv_max,
                      draft_forwards, draft_tokens_computed, draft_seconds,
                      draft_kv: {total_pages, free_pages, page_size},
                      recent_rounds: [{step, request, proposed, accepted, bonus, tv_mean}],
                      last_error},
      "last_step": {index, rows: [{id, phase, tokens, draft_tokens}], prefill_tokens, decode_rows,
                    decode_context_tokens, logits_rows, preempted: [id], kernel_paths: {path: calls}, duration_s},
      "kernels": {<kernel settings>,
                  cuda_graphs: null | {buckets, captured, replays, failed: {bucket: why},
                                       prefill: null | {buckets, captured, replays, failed}},
                  weight_bytes, gemv_weight_bytes, gemv_kinds: {kind: projections}},
      "counters": {steps, prefill_tokens, decode_tokens, preemptions, requests_submitted,
                   requests_finished, finished_stop, finished_length, finished_abort,
                   finished_error, rejected, steps_queued_ahead, step_us},
      "structured": {forced, masked_ahead, masked_at_draw, checked},  # how constrained tokens
                   # were drawn (sampling/constrained_draw.py): forced by the grammar with no
                   # mask, masked beside the forward, masked at the draw, settled by a check
    }

    request = {id, status, phase ("prefill" | "decode"), prompt_tokens, computed_tokens,
               output_tokens, max_tokens, restored_tokens, pages, block_table: [page ids],
               preemptions, flight: null | "leader" | "follower" | "released",
               waiting_on: null | leader id,
               speculation: null | {proposed, accepted, acceptance_rate, bonus_tokens, rounds,
                                    plain_steps, draft_length_histogram, tv_mean, tv_max,
                                    next_draft_tokens, draft_computed_tokens, draft_pages,
                                    gate: null | {state, plain_tokens_per_s,
                                                  speculative_tokens_per_s, pauses,
                                                  next_pause_tokens}}}

page_states (cache/page_pool.PAGE_STATES): free = no holder; owned = one request, not
cached; cached-idle = held by the prefix cache alone, evicted LRU on demand; cached-in-use
= cached and used by one request; shared = used by two or more requests.
"""

from __future__ import annotations

import time
from dataclasses import fields

from minivllm.kernels.kernel_options import KernelSettings, kernel_options_for_call

SCHEMA = "minivllm.engine.snapshot/1"


def schema_doc(template: str) -> str:
    """The schema above with the kernel settings listed from their declarations."""
    return template.replace("<kernel settings>", ", ".join(f.name for f in fields(KernelSettings)))


DOC_TEMPLATE = __doc__
__doc__ = schema_doc(DOC_TEMPLATE)


def build_snapshot(engine, scheduler, kv, requests: dict) -> dict:
    """`engine` for its public parts; its scheduler, KV manager and request table too."""
    cfg = engine.config
    model = engine.model
    return {
        "schema": SCHEMA,
        "engine": {
            "model": model.config.name,
            "architecture": model.config.architecture,
            "device": str(model.device),
            "activation_dtype": str(getattr(model, "matmul_dtype", model.dtype)).replace("torch.", ""),
            "kv_dtype": str(model.dtype).replace("torch.", ""),  # float32 in the CPU fast mode (bf16 matmuls only)
            "kv_mode": cfg.kv_mode,
            "page_size": engine.pool.page_size,
            "max_model_len": engine.max_model_len,
            "max_batched_tokens": cfg.max_batched_tokens,
            "max_active_requests": cfg.max_active_requests,
            "handoff_rows": cfg.handoff_rows,
            "policy": cfg.policy,
        },
        "queues": scheduler.snapshot(),
        # reserved_pages: held by the engine itself, not by a request (the CUDA graphs'
        # scratch page), so an idle engine has available_pages + reserved_pages == total_pages.
        "kv": {**engine.pool.snapshot(), "reserved_pages": 1 if engine.graph_runner is not None else 0},
        "last_step": dict(engine.last_step),
        "prefix_cache": describe_prefix_cache(engine, kv, requests),
        "speculative": describe_speculation(engine, scheduler),
        "kernels": describe_kernels(engine),
        "counters": dict(engine.counters),
        "structured": dict(engine.constraints.counts),
    }


def describe_prefix_cache(engine, kv, requests: dict) -> dict:
    cfg = engine.config
    flights = engine.flights
    section = {"enabled": kv.caching, "publication": cfg.publication, "single_flight": cfg.single_flight,
               **kv.describe_cache(),
               "flights": [], "released": [], "flight_counters": {}}
    if flights is not None:
        fs = flights.snapshot()
        for f in fs["flights"]:
            leader = requests.get(f["leader"])
            f["leader_phase"] = "waiting" if leader is None or leader.status.value != "running" else leader.phase
        section.update(flights=fs["flights"], released=fs["released"],
                       flight_counters=fs["counters"])
    return section


def describe_speculation(engine, scheduler) -> dict:
    spec = engine.speculator
    if spec is None:
        return {"enabled": False}
    return spec.snapshot(scheduler.running + scheduler.waiting, engine.runner.draft)


def describe_kernels(engine) -> dict:
    from collections import Counter

    model = engine.model
    # What each weight runs depends on the options in effect, and those are this engine's
    # (a fork over the same model may run others), so the kinds are read under them.
    with kernel_options_for_call(engine.kernel_options):
        kinds = Counter(getattr(layer, f).gemv_kind for layer in model.layers
                        for f in ("q", "k", "v", "o", "gate", "up", "down"))
        kinds[model.output.gemv_kind] += 1
    graphs, prefill = engine.graph_runner, engine.runner.prefill_graphs
    return {**engine.kernel_options.describe(),
            "cuda_graphs": None if graphs is None else {
                "buckets": graphs.buckets, "captured": sorted(graphs.graphs), "replays": graphs.replays,
                "failed": {str(b): why for b, why in graphs.failed.items()},
                "prefill": None if prefill is None else {
                    "buckets": prefill.buckets, "captured": sorted(prefill.graphs), "replays": prefill.replays,
                    "failed": {str(b): why for b, why in prefill.failed.items()}}},
            "weight_bytes": model.weight_bytes(), "gemv_weight_bytes": model.gemv_weight_bytes(),
            "gemv_kinds": dict(kinds)}


def describe_step(index: int, plan, t0: float, logits_rows: int) -> dict:
    """One step's entry in the snapshot ("last_step"): its rows, token counts, and time so far."""
    return {
        "index": index,
        "rows": [{"id": r.request.id, "phase": r.request.phase, "tokens": r.n_tokens,
                  "draft_tokens": r.draft_tokens} for r in plan.rows],
        "prefill_tokens": plan.prefill_tokens,
        "decode_rows": plan.decode_rows,
        "decode_context_tokens": plan.decode_context_tokens,
        "logits_rows": logits_rows,
        "preempted": [r.id for r in plan.preempted],
        "kernel_paths": {},  # calls per matmul path in this step's forward ("gemv", "gemm", ...)
        "duration_s": time.perf_counter() - t0,
    }
