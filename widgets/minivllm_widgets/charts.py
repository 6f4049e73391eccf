"""Plotly figures from `chart_data.Chart`s: live `FigureWidget`s and one-off figures.

A live chart is a `go.FigureWidget` built once; `update_figure` rewrites its traces and
axes inside one `batch_update()` (one message to the browser), which is what the
publisher thread calls when a panel's chart data changed. Hover shows each value with its
unit; the legend toggles a line. Where a chart would be empty the figure says so instead
of drawing axes over nothing.
"""

from __future__ import annotations

import datetime

import plotly.graph_objects as go

from minivllm_widgets.chart_data import Chart

PALETTE = ["#4285f4", "#ea4335", "#34a853", "#fbbc05", "#9c27b0"]
HEIGHT = 220


def _x(chart: Chart, values) -> list:
    if not chart.time_x:
        return list(values)
    return [datetime.datetime.fromtimestamp(v) for v in values]


def _traces(chart: Chart) -> list:
    traces = []
    for i, s in enumerate(chart.series):
        colour = PALETTE[i % len(PALETTE)]
        hover = f"{s.name}<br>%{{x}}<br>%{{y:.4g}} {chart.y_title}<extra></extra>"
        if chart.bars:
            traces.append(go.Bar(x=_x(chart, s.x), y=list(s.y), name=s.name, marker_color=colour, hovertemplate=hover))
        else:
            traces.append(go.Scatter(x=_x(chart, s.x), y=list(s.y), name=s.name, mode="lines+markers",
                                     marker={"size": 4}, line={"color": colour, "width": 1.5},
                                     connectgaps=False, hovertemplate=hover))
    return traces


def _layout(chart: Chart) -> dict:
    notes = "<br>".join(chart.notes)
    layout = {
        "title": {"text": chart.title, "font": {"size": 13}},
        "height": HEIGHT, "margin": {"l": 70, "r": 10, "t": 36, "b": 40 + 14 * len(chart.notes)},
        "xaxis": {"title": {"text": chart.x_title}, "automargin": True},
        "yaxis": {"title": {"text": chart.y_title}, "automargin": True, "type": "log" if chart.y_log else "linear",
                  "exponentformat": "e" if chart.y_log else "SI"},
        "legend": {"orientation": "h", "y": -0.3 if chart.notes else -0.25},
        "shapes": [], "annotations": [], "hovermode": "x unified" if chart.time_x else "closest",
        "template": "plotly_white",
    }
    if chart.time_x:  # clock time only: the date line under the ticks would run into the legend
        layout["xaxis"].update(tickformat="%H:%M:%S", title={"text": ""})
    if chart.x_range is not None:
        lo, hi = chart.x_range
        layout["xaxis"]["range"] = _x(chart, [lo, hi])
    if chart.mark_x is not None:
        layout["shapes"] = [{"type": "line", "x0": chart.mark_x, "x1": chart.mark_x, "yref": "paper", "y0": 0, "y1": 1,
                             "line": {"color": "#999", "dash": "dash"}}]
        layout["annotations"] = [{"x": chart.mark_x, "yref": "paper", "y": 1, "text": chart.mark_label,
                                  "showarrow": False, "yanchor": "bottom", "font": {"size": 10, "color": "#666"}}]
    if notes:
        layout["annotations"].append({"xref": "paper", "yref": "paper", "x": 0, "y": 0, "yshift": -60,
                                      "text": notes, "showarrow": False, "align": "left", "xanchor": "left",
                                      "font": {"size": 10, "color": "#666"}})
    if not chart.points:
        layout["annotations"].append({"xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False,
                                      "text": "no data yet", "font": {"size": 12, "color": "#999"}})
    return layout


def figure(chart: Chart) -> go.Figure:
    """A one-off figure (a notebook cell's plot)."""
    return go.Figure(data=_traces(chart), layout=_layout(chart))


def figure_widget(chart: Chart | None = None, *, css_class: str = "minivllm-chart") -> go.FigureWidget:
    """A live figure; `update_figure` redraws it in place."""
    fig = go.FigureWidget()
    fig.update_layout( template="plotly_white", margin={"l": 70, "r": 10, "t": 36, "b": 40})
    if chart is not None:
        update_figure(fig, chart)
    fig.add_class("minivllm-chart")  # the browser test's hook: every live chart is one of these
    if css_class != "minivllm-chart":
        fig.add_class(css_class)
    return fig


def update_figure(fig: go.FigureWidget, chart: Chart) -> None:
    """Redraw `fig` from `chart` in one message: traces updated in place when the series
    are the same lines as before, replaced when they changed."""
    traces = _traces(chart)
    with fig.batch_update():
        if [t.name for t in fig.data] == [t.name for t in traces] and all(
                type(a) is type(b) for a, b in zip(fig.data, traces)):
            for old, new in zip(fig.data, traces):
                old.x, old.y = new.x, new.y
        else:
            fig.data = []
            fig.add_traces(traces)
        fig.layout.shapes, fig.layout.annotations = [], []
        layout = _layout(chart)
        # a size the container gave this figure (the dashboard's small multiples) stays
        layout.update({k: v for k, v in (("height", fig.layout.height), ("width", fig.layout.width)) if v})
        fig.update_layout(layout)
