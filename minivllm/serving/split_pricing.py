"""The cost router's "prefill here, decode there" candidates (issue 43).

For every ordered pair of priced workers (A, B), the time until the incoming request
would be done if A ran its prefill and first token and B the rest:

    prefill_s  = A's time to the prompt's K/V (net of A's cached prefix) and one token:
                 started now in a free handoff row (EngineConfig.handoff_rows: the prefill
                 half leaves after its first token, so a worker with every slot taken can
                 still run it), else A's finish replayed (router.incoming_finish_s)
    transfer_s = bytes / the measured link rate; bytes = K/V bytes per token on A x the
                 prompt's full pages (what kv_transfer.read_blocks sends)
    decode_s   = B's finish for the rest, arriving at prefill_s + transfer_s: the tail
                 past the last full page (recomputed on B) and max_tokens - 1 tokens,
                 in B's FCFS slots at its per-request rate
    score      = decode_s (B's drain with this request added is shown, as drain_s)

which is the whole-request score (router.py: the request's own finish) with the transfer
in the middle.
`break_even_ms_per_token` is the articles' formula: how much faster per output token B
must decode to repay the transfer alone (transfer_s / max_tokens, as the articles count).
The router takes a split only when its score is below SPLIT_MARGIN times the best whole-request
score: the rates are estimates (two identical CPU workers calibrate a few percent apart),
and noise between equals must not buy a transfer.

Pairs are only priced where the request can move: a sampled request's RNG state goes
between workers of one device kind only (engine/handoff.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SPLIT_MARGIN = 0.9


@dataclass
class SplitPricing:
    """What the router needs beyond the candidates: the link and each worker's pages."""

    link_bytes_per_s: float
    kv_bytes_per_token: dict[str, float]  # per worker, in its pool's dtype
    page_size: dict[str, int]
    device_kind: dict[str, str]  # "cpu", "cuda"
    sampled: bool  # the request samples: its RNG state must land on the same device kind


@dataclass
class SplitCandidate:
    prefill: str
    decode: str
    transfer_tokens: int
    transfer_bytes: int
    link_mb_per_s: float
    prefill_s: float
    transfer_s: float
    decode_s: float
    drain_s: float
    score: float
    break_even_ms_per_token: float | None


def prefill_half_s(a, finish_s) -> float:
    """When A would have the prompt's K/V and the first token. In a free handoff row
    (EngineConfig.handoff_rows) it starts now, beside A's running requests, at A's prefill
    rate and one decode step at A's current concurrency; otherwise it waits for one of
    A's slots like any request (the FCFS replay)."""
    if a.handoffs < a.handoff_rows:
        return a.incoming_prefill_tokens / a.prefill_tps + a.concurrency / a.decode_tps
    return finish_s(dataclasses.replace(a, incoming_decode_tokens=1), 0.0)


def price_splits(prompt_tokens: int, max_tokens: int, priced: list, pricing: SplitPricing,
                 finish_s) -> list[SplitCandidate]:
    """Every (prefill, decode) pair of the priced candidates (their rates filled in by the
    cost policy); `finish_s(candidate, arrival)` is the router's FCFS replay."""
    out = []
    if max_tokens < 2:
        return out  # the prefill worker's first token is the whole answer: nothing to hand off
    for a in priced:
        if a.worker not in pricing.kv_bytes_per_token:
            continue
        page = pricing.page_size[a.worker]
        moved = (prompt_tokens // page) * page
        nbytes = int(moved * pricing.kv_bytes_per_token[a.worker])
        prefill_s = prefill_half_s(a, finish_s)
        transfer_s = nbytes / pricing.link_bytes_per_s
        for b in priced:
            if b.worker == a.worker or b.worker not in pricing.kv_bytes_per_token:
                continue
            if pricing.sampled and pricing.device_kind[a.worker] != pricing.device_kind[b.worker]:
                continue
            tail = prompt_tokens + 1 - moved  # B recomputes past the last full page, A's token included
            on_b = dataclasses.replace(b, incoming_prefill_tokens=tail, incoming_decode_tokens=max_tokens - 1)
            decode_s = finish_s(on_b, prefill_s + transfer_s)
            drain_s = ((b.existing_prefill_tokens + tail) / b.prefill_tps
                       + (b.existing_decode_tokens + max_tokens - 1) / b.decode_tps)
            out.append(SplitCandidate(a.worker, b.worker, moved, nbytes, pricing.link_bytes_per_s / 1e6, prefill_s,
                                      transfer_s, decode_s, drain_s, decode_s,
                                      transfer_s * 1e3 / max_tokens))
    return out
