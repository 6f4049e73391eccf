"""The chart series the plotly figures and the static SVG draw (widgets/chart_data.py),
against hand-computed values: gaps, no inf/NaN, one shared window, log axes."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace as NS

from minivllm_widgets.chart_data import (
    dashboard_charts,
    layer_chart,
    margin_chart,
    time_chart,
)
from minivllm_widgets.static_charts import chart_svg


def _tok(margin, text="x"):
    return NS(token_id=1, text=text, top=[NS(token_id=1, text=text, logit=2.0), NS(token_id=2, text="y", logit=1.0)],
              margin=margin)


def _report(a_margins, b_margins, split=None, layer_values=()):
    records = [NS(position=i, a=None if a is None else _tok(a), b=None if b is None else _tok(b))
               for i, (a, b) in enumerate(zip(a_margins, b_margins))]
    fd = None if split is None else NS(position=split, sequence_position=10 + split, identical_tokens=split,
                                       identical_chars=split)
    layers = [NS(layer=name, prefix_rel_l2=p, at_split_rel_l2=s, comparable=True, first_differing_position=None)
              for name, p, s in layer_values]
    return NS(records=records, first_divergence=fd, layer_diffs=layers, a_token_ids=[1] * len(records), a_options={},
              b_options={},
              prompt_token_ids=[0] * 10)


def test_idle_stretch_is_a_gap_not_a_ramp():
    chart = time_chart({"w": [(100.0, 5.0), (101.0, 6.0), (160.0, 7.0)]}, title="t", unit="tok/s", gap_s=3.0)
    s = chart.series[0]
    assert s.x == (100.0, 101.0, 130.5, 160.0) and s.y == (5.0, 6.0, None, 7.0)


def test_dashboard_charts_share_one_window():
    thr = {"w": [(1000.0, 10.0, 0.0), (1010.0, 12.0, 0.0)]}
    lat = {"w": [(900.0, 3.0), (1050.0, 4.0)]}  # the newest sample of either ends the window
    a, b = dashboard_charts(thr, lat, window_s=120.0)
    assert a.x_range == b.x_range == (930.0, 1050.0)
    assert b.series[0].x == (1050.0,)  # the sample older than the window is not drawn


def test_infinite_margins_never_reach_a_chart():
    """A constraint that allows one token leaves the runner-up at -inf: margin inf."""
    report = _report([1.5, math.inf, 0.25], [math.inf, math.inf, float("nan")], split=0)
    chart = margin_chart(report)
    assert chart.series[0].y == (1.5, None, 0.25) and chart.series[1].y == (None, None, None)
    assert chart.series[0].x == (1, 2, 3)  # generated tokens numbered from 1
    assert chart.mark_x == 1  # the split (position 0) is generated token 1
    assert chart.series[1].dropped == 3 and "side b: 3 token(s) not drawn" in chart.notes[-1]
    svg = chart_svg(chart)
    drawn = svg[svg.index("<svg"):]
    assert not re.search(r"nan|inf", drawn, re.IGNORECASE), drawn
    numbers = [float(v) for v in re.findall(r'(?:points|cx|cy)="([^"]+)"', drawn) for v in v.replace(",", " ").split()]
    assert numbers and all(math.isfinite(v) for v in numbers)


def test_layer_chart_goes_log_when_values_span_decades():
    report = _report([1.0], [1.0], split=0, layer_values=[("embedding", 0.0, 0.0), ("layer 0", 4.6e-6, 1e-5),
                                                          ("layer 1", 2.6e-2, 3e-2)])
    chart = layer_chart(report)
    assert chart.y_log  # 2.6e-2 / 4.6e-6 > 100: one linear axis would flatten the small one to 0
    assert chart.series[0].y == (None, 4.6e-6, 2.6e-2)  # an exact 0 cannot sit on a log axis: a gap, said so
    assert chart.notes and "exactly 0" in chart.notes[0]
    flat = layer_chart(_report([1.0], [1.0], split=0, layer_values=[("layer 0", 1e-3, 1e-3), ("layer 1", 2e-3, 2e-3)]))
    assert not flat.y_log and flat.series[0].y == (1e-3, 2e-3)


def test_static_chart_labels_do_not_repeat():
    chart = time_chart({"w": [(0.0, 84000.0), (1.0, 83000.0)]}, title="t", unit="tok/s", now=1.0, window_s=2.0)
    svg = chart_svg(chart)
    labels = re.findall(r'<text x="60"[^>]*>([^<]+)</text>', svg)  # the y labels, right-aligned at the axis
    assert labels == ["0", "4.2e+04", "8.4e+04"], labels  # the top one whole, not clipped to "84e+03"
    assert len(set(labels)) == len(labels), labels
