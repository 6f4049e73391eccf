"""Per-request timings (TTFT, TPOT, ITL, E2E) and the summary of a run: percentiles, throughput, goodput."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from minivllm.bench.common import percentile


@dataclass
class RequestResult:
    """One request; times are perf_counter seconds relative to the start of the run."""

    index: int
    input_len: int
    output_len: int
    ok: bool = False
    error: str | None = None
    status: int | None = None
    send_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)  # arrival of each content chunk
    end_s: float | None = None
    prompt_tokens: int | None = None  # from usage
    output_tokens: int | None = None  # from usage, else the number of token-carrying chunks
    tokens_from: str | None = None  # "usage" | "chunks"
    finish_reason: str | None = None
    text_chars: int = 0
    token_chunks: int = 0  # content chunks that carry a token (not a bare finish_reason)
    got_done: bool = False

    def fail(self, error: str, t: float) -> None:
        self.ok, self.error, self.end_s = False, error, t


def request_metrics(send_s: float, chunk_s: list[float], end_s: float, output_tokens: int) -> dict:
    """TTFT, ITLs, TPOT and E2E (seconds) of one request from its timestamps.
    TPOT is None for requests of fewer than 2 output tokens."""
    if not chunk_s:
        raise ValueError("a request without content chunks has no TTFT")
    ttft = chunk_s[0] - send_s
    e2e = end_s - send_s
    itl = [b - a for a, b in zip(chunk_s, chunk_s[1:])]
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens and output_tokens > 1 else None
    return {"ttft_s": ttft, "e2e_s": e2e, "tpot_s": tpot, "itl_s": itl}


def stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None, "std": None, "min": None, "max": None}
    return {"n": len(values), "mean": statistics.fmean(values), "median": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "std": statistics.pstdev(values),
            "min": min(values), "max": max(values)}


def meets_slo(m: dict, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and not m["ttft_s"] * 1000.0 <= slo_ttft_ms:
        return False
    if slo_tpot_ms is not None and m["tpot_s"] is not None and not m["tpot_s"] * 1000.0 <= slo_tpot_ms:
        return False
    return True


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, ignore_eos: bool = True) -> dict:
    """The run's metrics from its requests (failed ones counted, and left out of every metric)."""
    ok = [r for r in results if r.ok]
    per = [request_metrics(r.send_s, r.chunk_s, r.end_s, r.output_tokens) for r in ok]
    duration_s = max(duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    usage_prompt = all(r.prompt_tokens is not None for r in ok)
    input_tokens = sum((r.prompt_tokens if usage_prompt else r.input_len) for r in ok)
    slo_given = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slo(m, slo_ttft_ms, slo_tpot_ms) for m in per)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "?")[:300]
            errors[key] = errors.get(key, 0) + 1
    ms = lambda xs: [x * 1000.0 for x in xs]  # noqa: E731
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "input_tokens_from": "usage" if usage_prompt else "requested lengths (approximate)",
        "total_output_tokens": output_tokens,
        "output_tokens_from": "usage" if all(r.tokens_from == "usage" for r in ok) else "content chunks (approximate)",
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "good_requests": good if slo_given else None,
        "goodput": good / duration_s if slo_given else None,
        "ttft_ms": stats(ms(m["ttft_s"] for m in per)),
        "tpot_ms": stats(ms(m["tpot_s"] for m in per if m["tpot_s"] is not None)),
        "itl_ms": stats(ms(x for m in per for x in m["itl_s"])),
        "e2e_ms": stats(ms(m["e2e_s"] for m in per)),
        "prompt_tokens": stats([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "output_tokens": stats([r.output_tokens for r in ok]),
        "output_len_mismatch": sum(r.output_tokens != r.output_len for r in ok) if ignore_eos else None,
        "peak_in_flight": peak_in_flight(results),
        "errors": [{"error": k, "count": v} for k, v in sorted(errors.items(), key=lambda kv: -kv[1])[:5]],
    }


def peak_in_flight(results: list[RequestResult]) -> int:
    events = sorted([(r.send_s, 1) for r in results if r.end_s is not None]
                    + [(r.end_s, -1) for r in results if r.end_s is not None], key=lambda e: (e[0], e[1]))
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak
