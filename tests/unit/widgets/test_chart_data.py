"""The chart series the plotly figures draw (widgets/chart_data.py), live and static,
against hand-computed values: gaps, no inf/NaN, one shared window, log axes. The static
renders are read back from the HTML plotly.io writes (tests/plotly_html.py: the
`Plotly.newPlot` arguments as strict JSON, so a NaN or Infinity fails the parse)."""

from __future__ import annotations

import datetime
import json
import math
from types import SimpleNamespace as NS

import plotly_html
import pytest

from minivllm_widgets.chart_data import (
    dashboard_charts,
    layer_chart,
    margin_chart,
    time_chart,
)
from minivllm_widgets.charts import figure_widget
from minivllm_widgets.divergence_views import layers_html, margins_html
from minivllm_widgets.html_views import throughput_static_html
from minivllm_widgets.static_charts import chart_html, plotlyjs_html


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
    (static,) = plotly_html.figures(margins_html(report))  # what plotly.js is handed, strict JSON
    a, b = static["data"]
    assert (a["name"], a["x"], a["y"]) == ("side a", [1, 2, 3], [1.5, None, 0.25])
    assert (b["name"], b["y"]) == ("side b", [None, None, None])
    assert plotly_html.finite_points(static) == [1.5, 0.25]
    assert [s["x0"] for s in static["layout"]["shapes"]] == [1]  # the split, marked


def test_layer_chart_goes_log_when_values_span_decades():
    report = _report([1.0], [1.0], split=0, layer_values=[("embedding", 0.0, 0.0), ("layer 0", 4.6e-6, 1e-5),
                                                          ("layer 1", 2.6e-2, 3e-2)])
    chart = layer_chart(report)
    assert chart.y_log  # 2.6e-2 / 4.6e-6 > 100: one linear axis would flatten the small one to 0
    assert chart.series[0].y == (None, 4.6e-6, 2.6e-2)  # an exact 0 cannot sit on a log axis: a gap, said so
    assert chart.notes and "exactly 0" in chart.notes[0]
    flat = layer_chart(_report([1.0], [1.0], split=0, layer_values=[("layer 0", 1e-3, 1e-3), ("layer 1", 2e-3, 2e-3)]))
    assert not flat.y_log and flat.series[0].y == (1e-3, 2e-3)


def test_static_layer_chart_is_the_plotly_figure_on_a_log_axis():
    report = _report([1.0], [1.0], split=0, layer_values=[("layer 0", 4.6e-6, 1e-5), ("layer 1", 2.6e-2, 3e-2)])
    (static,) = plotly_html.figures(layers_html(report))
    assert static["layout"]["yaxis"]["type"] == "log"
    assert [(t["x"], t["y"]) for t in static["data"]] == [(["layer 0", "layer 1"], [4.6e-6, 2.6e-2]),
                                                          (["layer 0", "layer 1"], [1e-5, 3e-2])]


def test_static_dashboard_charts_are_plotly_figures_over_one_window():
    t0 = 1_700_000_000.0
    html = throughput_static_html({"w": [(t0, 10.0, 0.0), (t0 + 1, 20.0, 0.0)]},
                                  {"w": [(t0 + 1, 4.5), (t0 + 30, 5.5)]})  # 29 s apart: a gap between them
    decode, latency = plotly_html.figures(html)
    assert "<svg" not in html  # no drawing of ours: plotly.js draws the figure
    clock = [datetime.datetime.fromtimestamp(t).isoformat() for t in (t0 - 90, t0 + 30)]  # the 120 s window
    assert decode["layout"]["xaxis"]["range"] == latency["layout"]["xaxis"]["range"] == clock
    assert decode["data"][0]["y"] == [10.0, 20.0] and plotly_html.finite_points(decode) == [10.0, 20.0]
    assert latency["data"][0]["y"] == [4.5, None, 5.5]  # the idle stretch is a gap, not a ramp
    assert latency["data"][0]["x"][1] == datetime.datetime.fromtimestamp(t0 + 15.5).isoformat()
    assert decode["layout"]["title"]["text"] == "decode throughput"


def test_static_render_is_the_live_figure():
    """One figure builder: the static HTML holds the traces and axes the FigureWidget shows."""
    chart = time_chart({"w": [(0.0, 84000.0), (1.0, 83000.0)]}, title="t", unit="tok/s", now=1.0, window_s=2.0)
    (static,) = plotly_html.figures(chart_html(chart))
    live = json.loads(figure_widget(chart).to_json())  # plotly's own encoder: datetimes as ISO text
    assert static["data"] == [{k: v for k, v in t.items() if k != "uid"} for t in live["data"]]
    for key in ("xaxis", "yaxis", "title", "shapes", "annotations"):
        assert static["layout"].get(key) == live["layout"].get(key), key


def test_a_chart_without_points_is_text_and_non_finite_json_is_refused():
    empty = margin_chart(_report([math.inf], [math.inf], split=0))
    html = chart_html(empty)
    assert plotly_html.figures(html) == [] and "no data" in html and "not drawn" in html
    with pytest.raises(ValueError, match="NaN"):  # the reader itself catches what plotly.js must never get
        plotly_html.figures('<div id="p"></div>Plotly.newPlot("p", [{"y": [NaN]}], {}, {})')


def test_plotlyjs_is_plotlys_own_bundle_inline():
    from plotly.offline import get_plotlyjs

    script = plotlyjs_html()
    assert get_plotlyjs() in script and "http" not in script[:200]  # inline, no network at view time
