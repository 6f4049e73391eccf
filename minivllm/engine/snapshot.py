"""`engine.snapshot()`: the engine's state as a plain JSON-serialisable dict.

This is a contract: the widgets, the router and the tests read only this. Schema
(all keys always present; times in seconds):

    {
      "schema": "minivllm.engine.snapshot/1",
      "engine": {model, architecture, device, activation_dtype, kv_mode, page_size,
                 max_model_len, max_batched_tokens, max_active_requests, policy},
      "queues": {
        "policy": str,
        "waiting":   [request],    # never scheduled yet
        "preempted": [request],    # evicted, waiting to be recomputed
        "running":   [request],    # holding pages; prefilling or decoding
      },
      "kv": {page_size, total_pages, free_pages, used_pages, bytes,
             "page_states": ["free" | "owned" | "cached-idle" | "shared", ...],  # one per page
             "ref_counts": [int, ...]},                                         # one per page
      "last_step": {index, rows: [{id, phase, tokens}], prefill_tokens, decode_rows,
                    logits_rows, preempted: [id], kernel_paths: {path: calls}, duration_s},
      "kernels": {gemv_max_rows, dequant_cache, batch_invariant,
                  cuda_graphs: null | {buckets, captured, replays, failed: {bucket: why}},
                  weight_bytes, gemv_kinds: {kind: projections}},
      "counters": {steps, prefill_tokens, decode_tokens, preemptions, requests_submitted,
                   requests_finished, finished_stop, finished_length, finished_abort,
                   finished_error, rejected},
    }

    request = {id, status, phase ("prefill" | "decode"), prompt_tokens, computed_tokens,
               output_tokens, max_tokens, pages, block_table: [page ids], preemptions}
"""

from __future__ import annotations

SCHEMA = "minivllm.engine.snapshot/1"


def build_snapshot(engine) -> dict:
    cfg = engine.config
    model = engine.model
    return {
        "schema": SCHEMA,
        "engine": {
            "model": model.config.name,
            "architecture": model.config.architecture,
            "device": str(model.device),
            "activation_dtype": str(model.dtype).replace("torch.", ""),
            "kv_mode": cfg.kv_mode,
            "page_size": engine.pool.page_size,
            "max_model_len": engine.max_model_len,
            "max_batched_tokens": cfg.max_batched_tokens,
            "max_active_requests": cfg.max_active_requests,
            "policy": cfg.policy,
        },
        "queues": engine.scheduler.snapshot(),
        "kv": engine.pool.snapshot(),
        "last_step": dict(engine.last_step),
        "kernels": engine.describe_kernels(),
        "counters": dict(engine.counters),
    }
