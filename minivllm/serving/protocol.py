"""Messages between the controller and a worker: plain dicts with an "op" key.

controller -> worker
    {"op": "submit", "request_id", "prompt_ids", "prompt", "params": {SamplingParams fields}}
        + for the prefill half of a split request: "export_after" (tokens), "segment" (name)
    {"op": "import", "request_id", "params", "handoff": {handoff}}   the decode half of a split request
    {"op": "abort", "request_id"}
    {"op": "prefix_query", "qid", "prompt_ids"}     -> reply {"tokens": int held in its prefix cache}
    {"op": "snapshot", "qid"}                       -> reply {engine snapshot}
    {"op": "shutdown"}

worker -> controller
    {"op": "loading", "stage"}                      progress while the model loads
    {"op": "ready", "info", "rates"}                after loading, warm-up and calibration
    {"op": "failed", "error"}                       loading failed; the process exits
    {"op": "events", "events": [event]}             token events in step order
    {"op": "rejected", "request_id", "field", "error"}
    {"op": "exported", "request_id", "handoff", "metrics", "started_at" (time.time()), "export_ms"}
                                                    the request left, its K/V in the segment; no terminal event
    {"op": "imported", "request_id", "read_ms", "import_ms", "finished_at" (time.time())}
                                                    the segment is copied in and unlinked; tokens follow as events
    {"op": "reply", "qid", "result"}
    {"op": "progress", "running": {request_id: prompt tokens computed}}   after a step that changed it
    {"op": "state", "snapshot", "rates"}            every state_interval_s while busy, and when idle
    {"op": "heartbeat", "loop_age_s"}               from a side thread, every heartbeat_s
    {"op": "bye"}

event = {"request_id", "token_id", "text", "finished", "finish_reason", "error", "logprobs",
         "metrics" (finished only: RequestMetrics.as_dict())}

handoff = {"segment", "nbytes", "link_bytes", "dtype", "kv_shape", "model_shape", "kv_token_ids", "prompt_ids",
           "output_ids", "generator_state" (base64 of torch's RNG state, or None), "generator_device",
           "write_ms"}    (kv_segment.py: the K/V bytes are in the shared-memory segment, k then v;
                           kv_landing.py: "landed" instead of "segment", link_bytes in the importer's dtype)
"""

from __future__ import annotations

from dataclasses import asdict

from minivllm.sampling.outputs import TokenEvent
from minivllm.sampling.sampling_params import SamplingParams


def params_to_wire(params: SamplingParams) -> dict:
    return asdict(params)


def params_from_wire(d: dict) -> SamplingParams:
    return SamplingParams(**d)


def event_to_wire(event: TokenEvent, metrics: dict | None = None) -> dict:
    d = {"request_id": event.request_id, "token_id": event.token_id, "text": event.text, "finished": event.finished,
         "finish_reason": event.finish_reason, "error": event.error,
         "logprobs": None if event.logprobs is None else [[t, lp] for t, lp in event.logprobs.items()]}
    if metrics is not None:
        d["metrics"] = metrics
    return d


def event_from_wire(d: dict) -> TokenEvent:
    logprobs = None if d.get("logprobs") is None else {int(t): float(lp) for t, lp in d["logprobs"]}
    return TokenEvent(
        d["request_id"], d["token_id"], d["text"], d["finished"], d["finish_reason"], logprobs, d.get("error")
    )
