"""Chart series as plain data: what the plotly figures draw, live and static.

Pure functions (no plotly, no widgets), so the numbers a chart shows are tested without a
browser, and the live figure and the static fallback cannot disagree. Two rules hold here
for every series:
- a value that is not a finite number (an infinite margin where a constraint allowed only
  one token, a NaN) never reaches a chart: it becomes a gap (None) and is counted, so the
  chart can say how many points it left out;
- a time series breaks (a None between two points) where the samples are further apart
  than `gap_s`: an idle stretch is drawn as a gap, never as a ramp between its two ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DASHBOARD_WINDOW_S = 120.0  # the window every dashboard time series shares
GAP_S = 3.0  # samples further apart than this (s) are not joined by a line


def finite(value) -> float | None:
    """The value as a float, or None (a gap) when it is missing, infinite or NaN."""
    if value is None:
        return None
    v = float(value)
    return v if math.isfinite(v) else None


@dataclass(frozen=True)
class Series:
    """One line: x and y of equal length; None in y is a gap."""

    name: str
    x: tuple
    y: tuple
    dropped: int = 0  # points left out because their value was not finite


@dataclass(frozen=True)
class Chart:
    """Everything a figure needs, as comparable data (the publisher sends a chart only when
    this changed)."""

    title: str
    x_title: str
    y_title: str
    series: tuple[Series, ...]
    x_range: tuple | None = None
    y_log: bool = False
    time_x: bool = False  # x holds epoch seconds, drawn as clock time
    bars: bool = False
    mark_x: float | None = None  # a vertical marker (the split)
    mark_label: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def points(self) -> int:
        return sum(v is not None for s in self.series for v in s.y)


def _gapped(samples, gap_s: float):
    xs, ys, dropped, prev_t = [], [], 0, None
    for t, v in samples:
        y = finite(v)
        dropped += y is None and v is not None
        if prev_t is not None and t - prev_t > gap_s:
            xs.append((t + prev_t) / 2)  # a gap point between the two samples
            ys.append(None)
        xs.append(t)
        ys.append(y)
        prev_t = t
    return tuple(xs), tuple(ys), dropped


def time_chart(series: dict[str, list[tuple[float, float]]], *, title: str, unit: str, now: float | None = None,
               window_s: float = DASHBOARD_WINDOW_S, gap_s: float = GAP_S) -> Chart:
    """(epoch seconds, value) samples per worker -> a chart over [now - window_s, now]. Pass
    the same `now` and `window_s` to every chart of a dashboard: they then share one window."""
    if now is None:
        now = max((t for s in series.values() for t, _ in s), default=0.0)
    start = now - window_s
    out = []
    for name, samples in series.items():
        xs, ys, dropped = _gapped([(t, v) for t, v in samples if t >= start], gap_s)
        out.append(Series(name, xs, ys, dropped))
    return Chart(title=title, x_title="time", y_title=unit, series=tuple(out), x_range=(start, now),
                 time_x=True)


def dashboard_charts(throughput: dict[str, list[tuple[float, float, float]]],
                     step_ms: dict[str, list[tuple[float, float]]], *, now: float | None = None,
                     window_s: float = DASHBOARD_WINDOW_S) -> tuple[Chart, Chart]:
    """The dashboard's two time series (decode tok/s, step latency) over one shared window
    that ends at the newest sample of either."""
    if now is None:
        now = max([t for s in throughput.values() for t, _, _ in s] + [t for s in step_ms.values() for t, _ in s],
                  default=0.0)
    decode = {name: [(t, v) for t, v, _ in s] for name, s in throughput.items()}
    return (time_chart(decode, title="decode throughput", unit="tokens/s", now=now, window_s=window_s),
            time_chart(step_ms, title="step latency (between two tokens of a request)", unit="ms",
                       now=now, window_s=window_s))


def _positive_span(values) -> float:
    pos = [v for v in values if v is not None and v > 0]
    return max(pos) / min(pos) if pos else 1.0


def margin_chart(report) -> Chart:
    """Top-1 minus top-2 logit per generated token (numbered from 1), both sides on one y
    axis, the split marked. Infinite margins (a constraint allowed one token) are gaps."""
    series, notes = [], []
    for side in "ab":
        toks = [(r.position + 1, getattr(r, side)) for r in report.records if getattr(r, side) is not None]
        ys = tuple(finite(t.margin) for _, t in toks)
        dropped = sum(y is None for y in ys)
        series.append(Series(f"side {side}", tuple(n for n, _ in toks), ys, dropped))
        if dropped:
            notes.append(f"side {side}: {dropped} token(s) not drawn, where only one token was allowed "
                         f"(the runner-up was masked to -inf: an infinite margin)")
    fd = report.first_divergence
    return Chart(title="top-1 minus top-2 logit per generated token (small = a near-tie)", x_title="generated token",
                 y_title="margin (logits)", series=tuple(series), mark_x=None if fd is None else fd.position + 1,
                 mark_label="split", notes=tuple(notes))


def layer_chart(report) -> Chart | None:
    """Relative L2 of b's residual stream against a's, per layer; a log axis when the values
    span more than a factor 100 (so 4.6e-6 and 2.6e-2 do not look alike)."""
    shown = [d for d in report.layer_diffs if getattr(d, "comparable", True)]
    if not shown:
        return None
    names = tuple(d.layer for d in shown)
    prefix = tuple(finite(d.prefix_rel_l2) for d in shown)
    at_split = tuple(finite(d.at_split_rel_l2) for d in shown)
    log = _positive_span(prefix + at_split) > 100
    notes = ()
    if log and any(v == 0 for v in prefix + at_split):
        notes = ("a relative L2 of exactly 0 (identical) cannot sit on the log axis: those layers are gaps",)
        prefix = tuple(None if v == 0 else v for v in prefix)
        at_split = tuple(None if v == 0 else v for v in at_split)
    return Chart(title="how far side b's residual stream is from side a's, per layer", x_title="after layer",
                 y_title="relative L2 ||b - a|| / ||a||", y_log=log, notes=notes,
                 series=(Series("over the whole prefix (what the KV cache holds)", names, prefix),
                         Series("at the split row", names, at_split)))


def bar_chart(values: dict[str, float], *, title: str, unit: str) -> Chart:
    """One bar per label (the notebooks' benchmark plots)."""
    return Chart(title=title, x_title="", y_title=unit, bars=True,
                 series=(Series(unit, tuple(values), tuple(finite(v) for v in values.values())),))
