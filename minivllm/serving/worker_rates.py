"""A worker's processing rates: what the cost router divides remaining work by.

Two numbers per worker, both *aggregate* throughput of the worker (tokens per second of
wall time, all requests together), because the router's score asks "how long until this
worker has worked off everything it holds", not how fast one request runs alone:

- prefill_tps: prompt tokens computed per second;
- decode_tps(batch): decode tokens per second with `batch` requests decoding together.
  Batched decode is memory-bound, so batch 4 yields several times batch 1's tokens/s; the
  model keeps one measured point per calibrated batch size and interpolates between them.

Sources, in order: a profile file (`load_profile`), a short calibration when the worker
starts (worker.py), and then online correction: every engine step is a measurement. A
decode-only step with b rows and duration t observed b/t tokens/s at batch b; a step
with P prefill tokens observed P / (t - decode share). Each observation nudges a
multiplicative correction (EWMA, alpha 0.2), so one odd step cannot swing routing but a
machine that got busier is noticed within a few steps. Decode corrections are kept per
batch size, because calibration and traffic disagree differently at different batch
sizes (on the H200 box the CPU's batch-4 rate under a burst of 516-token prompts was 0.7x
its calibration while batch 1 matched); a batch size not yet observed borrows the
nearest observed one's correction. The corrected curve is the calibrated points and the
observed batch sizes, each base rate times its correction, interpolated linearly.
(Fixed profiles would not follow the machine, and per-request rates under batching
would understate a worker's throughput, which is why the steps, not the requests, are the measurements.)

The context term. A decode step also reads every row's K/V, so it is slower the longer
the rows' contexts: on the H100 machine's CPU worker (Qwen2.5-0.5B, 8 threads, f32 K/V of
24.6 KB a token) a row at 4096 tokens reads ~100 MB a step that calibration at 128 tokens
never saw, and the router priced two such decodes at a third of what they took (issue 43,
docs/disaggregation.md). So the rates keep `context_s`: step seconds per token of context
beyond the `calibration_context` each row had when the decode points were measured,

    step_s(batch, context) = batch / decode_rate(batch) + context_s * max(0, context - batch * calibration_context)

(context: the step's rows' context tokens, summed), measured at start-up from batch-1 decode
at two context lengths (calibration.py). Online corrections take the context term out of
a step's time first, so they correct the batch curve, not the missing context.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.errors import ConfigError

ALPHA = 0.2
# Corrections stay within this factor of the calibration: a step that stalled on a page
# fault or a GC pause must not make a device look 100x slower.
CLAMP = 8.0
MIN_STEP_S = 1e-4


@dataclass
class WorkerRates:
    prefill_tps: float | None = None
    decode_points: dict[int, float] = field(default_factory=dict)  # batch -> decode tokens/s
    source: str = "none"  # "calibration", "profile" or "none"
    prefill_correction: float = 1.0
    decode_corrections: dict[int, float] = field(default_factory=dict)  # batch -> correction
    observations: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    context_s: float = 0.0  # decode step seconds per context token beyond calibration_context a row
    calibration_context: int = 0  # each row's context when decode_points were measured

    @property
    def known(self) -> bool:
        return self.prefill_tps is not None and bool(self.decode_points)

    def prefill_rate(self) -> float | None:
        return None if self.prefill_tps is None else self.prefill_tps * self.prefill_correction

    def decode_correction_at(self, batch: int) -> float:
        if not self.decode_corrections:
            return 1.0
        if batch in self.decode_corrections:
            return self.decode_corrections[batch]
        nearest = min(self.decode_corrections, key=lambda b: (abs(b - batch), b))
        return self.decode_corrections[nearest]

    def corrected_decode_points(self) -> dict[int, float]:
        keys = sorted(set(self.decode_points) | set(self.decode_corrections))
        return {b: self._decode_base(b) * self.decode_correction_at(b) for b in keys}

    def decode_rate(self, batch: int = 1) -> float | None:
        if not self.decode_points:
            return None
        return _interpolate(self.corrected_decode_points(), batch)

    def decode_step_s(self, batch: int, context_tokens: int | None = None) -> float | None:
        """One decode step's seconds with `batch` rows holding `context_tokens` tokens of
        context in all (None: as calibrated)."""
        rate = self.decode_rate(batch)
        if rate is None:
            return None
        return batch / rate + self._context_part(batch, context_tokens)

    def _context_part(self, batch: int, context_tokens: int | None) -> float:
        if context_tokens is None:
            return 0.0
        return self.context_s * max(0, context_tokens - batch * self.calibration_context)

    def _decode_base(self, batch: int) -> float | None:
        if not self.decode_points:
            return None
        return _interpolate(self.decode_points, batch)


    # -- online correction ---------------------------------------------------------------

    def observe_step(self, prefill_tokens: int, decode_rows: int, duration_s: float,
                     context_tokens: int | None = None) -> None:
        """One engine step's counts and wall time (speculative rounds excluded by the
        caller); `context_tokens`: its decode rows' context, summed (the context term is
        taken out of a decode-only step's time before it corrects the batch curve)."""
        if duration_s < MIN_STEP_S or not self.known:
            return
        if prefill_tokens == 0 and decode_rows > 0:
            base_s = duration_s - self._context_part(decode_rows, context_tokens)
            if base_s < MIN_STEP_S:
                return
            observed = decode_rows / base_s
            current = self.decode_correction_at(decode_rows)  # a new batch size starts from its neighbour's
            self.decode_corrections[decode_rows] = self._nudge(current, observed / self._decode_base(decode_rows))
            self.observations["decode"] += 1
        elif prefill_tokens > 0:
            decode_share = decode_rows / self.decode_rate(decode_rows) if decode_rows else 0.0
            prefill_time = duration_s - decode_share
            if prefill_time < MIN_STEP_S:
                return
            observed = prefill_tokens / prefill_time
            self.prefill_correction = self._nudge(self.prefill_correction, observed / self.prefill_tps)
            self.observations["prefill"] += 1

    @staticmethod
    def _nudge(current: float, ratio: float) -> float:
        if not math.isfinite(ratio) or ratio <= 0:
            return current
        updated = (1 - ALPHA) * current + ALPHA * ratio
        return min(CLAMP, max(1 / CLAMP, updated))

    # -- wire format ------------------------------------------------------------------------

    def as_dict(self) -> dict:
        return {
            "prefill_tps": self.prefill_rate(),
            "decode_tps": {str(b): r for b, r in self.corrected_decode_points().items()},
            "calibrated": {
                "prefill_tps": self.prefill_tps,
                "decode_tps": {str(b): r for b, r in sorted(self.decode_points.items())},
            },
            "prefill_correction": self.prefill_correction,
            "decode_corrections": {str(b): c for b, c in sorted(self.decode_corrections.items())},
            "observations": dict(self.observations),
            "source": self.source,
            "context_s": self.context_s,
            "calibration_context": self.calibration_context,
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> "WorkerRates":
        """Rebuild from `as_dict()` (as the controller receives it): the corrected rates
        become the new base so `decode_rate(b)` is what the worker currently measures."""
        if not d or d.get("prefill_tps") is None:
            return cls()
        return cls(
            prefill_tps=float(d["prefill_tps"]),
            decode_points={int(b): float(r) for b, r in d["decode_tps"].items()},
            source=d.get("source", "profile"),
            observations=dict(d.get("observations", {})),
            context_s=float(d.get("context_s") or 0.0),
            calibration_context=int(d.get("calibration_context") or 0),
        )


def _interpolate(points: dict[int, float], batch: int) -> float:
    """Linear between measured batch sizes; flat beyond the ends (no extrapolation)."""
    ordered = sorted(points.items())
    batch = max(1, batch)
    if batch <= ordered[0][0]:
        return ordered[0][1]
    for (b0, r0), (b1, r1) in zip(ordered, ordered[1:]):
        if b0 <= batch <= b1:
            return r0 + (r1 - r0) * (batch - b0) / (b1 - b0)
    return ordered[-1][1]


def profile_of(model_name: str, rates: dict[str, WorkerRates]) -> dict:
    """Workers' current (calibrated and corrected) rates in the profile-file format that
    `load_profile` reads; workers without known rates are left out."""
    return {"model": model_name,
            "workers": {name: {"prefill_tps": r.prefill_rate(),
                               "decode_tps": {str(b): r.decode_rate(b) for b in r.decode_points},
                               "context_s": r.context_s, "calibration_context": r.calibration_context}
                        for name, r in rates.items() if r.known}}


def load_profile(path: str | Path, worker: str) -> WorkerRates:
    """Rates for `worker` (a name like "cpu" or "cuda:0") from a profile file:
    {"workers": {"cpu": {"prefill_tps": 73, "decode_tps": {"1": 45, "4": 120}}, ...}}, and
    optionally the context term ("context_s", "calibration_context"; none if absent)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        entry = data["workers"][worker]
        rates = WorkerRates(prefill_tps=float(entry["prefill_tps"]),
                            decode_points={int(b): float(r) for b, r in entry["decode_tps"].items()}, source="profile",
                            context_s=float(entry.get("context_s") or 0.0),
                            calibration_context=int(entry.get("calibration_context") or 0))
    except FileNotFoundError:
        raise ConfigError(
            "rates_profile", str(path), "no such file; write one with Cluster.save_rates_profile()"
        ) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(
            "rates_profile",
            str(path),
            f"has no valid entry for worker {worker!r} ({exc!r}); expected "
            '{"workers": {"<worker>": {"prefill_tps": float, "decode_tps": {"<batch>": float}}}}',
        ) from None
    if rates.prefill_tps <= 0 or not rates.decode_points or min(rates.decode_points.values()) <= 0:
        raise ConfigError("rates_profile", str(path), f"rates for {worker!r} must be positive")
    if not math.isfinite(rates.context_s) or rates.context_s < 0 or rates.calibration_context < 0:
        raise ConfigError("rates_profile", str(path), f"the context term for {worker!r} must be finite and >= 0")
    return rates
