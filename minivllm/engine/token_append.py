"""One token appended to a request: its text, and whether the request ends on it.

Called only by `Scheduler.update` (the one place requests advance), which finishes the
request (pages, flights, counters) when `Appended.reason` says so. No KV here.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.sampling.constraint import Unsatisfiable


@dataclass
class Appended:
    token: int  # the event's token: -1 when the request failed on it
    text: str  # the text the event carries
    reason: str | None = None  # "stop" | "length" | "error" when the request ends here
    error: str | None = None


def constraint_error(req, exc: Exception) -> str:
    return f"the structured output ({req.params.structured.kind}) cannot be completed: {exc}"


def append_token(req, token: int, eos_ids, max_model_len: int) -> Appended:
    """Append `token` to `req` (output ids, metrics, constraint matcher, detokenizer and
    stop strings) and say whether it ends the request."""
    if not req.output_ids:
        req.metrics.time_to_first_token_s = req.since_arrival()
    req.output_ids.append(token)
    req.metrics.output_tokens = len(req.output_ids)
    req.metrics.e2e_s = req.since_arrival()
    params = req.params
    if req.constraint is not None:
        try:
            req.constraint.advance(token)
        except Unsatisfiable as exc:
            return Appended(-1, req.stops.flush(), "error", constraint_error(req, exc))
    eos = (not params.ignore_eos) and token in eos_ids
    if eos or token in params.stop_token_ids:
        # The stop token's own text is not part of the output.
        text, _ = req.stops.feed(req.detok.flush())
        return Appended(token, text + req.stops.flush(), "stop")
    text, hit = req.stops.feed(req.detok.push(token))
    if hit:
        return Appended(token, text, "stop")
    complete = req.constraint is not None and req.constraint.stopped  # the grammar admits nothing more
    if complete or len(req.output_ids) >= params.max_tokens or req.num_tokens >= max_model_len:
        more, _ = req.stops.feed(req.detok.flush())
        return Appended(token, text + more + req.stops.flush(), "stop" if complete else "length")
    return Appended(token, text)
