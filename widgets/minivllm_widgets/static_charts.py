"""The static fallback of a `chart_data.Chart` (and of the KV page map, `page_map_figure`):
the live chart's own plotly figure, written as HTML that plotly.js draws (nbconvert, a
Kaggle "Save & Run All" commit, `show_static()`).

The figure comes from `charts.figure`, built by the same trace and layout code as the live
`FigureWidget`, so the static chart and the live one cannot disagree; plotly.io.to_html
writes it as a div and a `Plotly.newPlot` call holding the data as JSON.

How plotly.js reaches the page: inline, once per output (`plotlyjs_html()`, plotly's own
bundled plotly.min.js, ~5 MB), at the top of each static output (`report_html`,
`Workbench.static_html`), and every chart in that output loads none of its own. Why inline
and not 'cdn' or 'require': a saved notebook must draw its charts offline (an exported
HTML file opened without network, a Kaggle commit viewed later), and each output must draw
on its own, whichever other outputs were kept or cleared. The price is the notebook's size
when saved with outputs, never the repository's (notebooks are committed without outputs).
"""

from __future__ import annotations

import html

import plotly.io as pio
from plotly.offline import get_plotlyjs

from minivllm_widgets.chart_data import Chart
from minivllm_widgets.charts import figure

CSS_CLASS = "minivllm-static-chart"  # the browser test's hook: each holds one plotly plot
CONFIG = {"displaylogo": False, "responsive": True}


def plotlyjs_html() -> str:
    """plotly.js itself, inline (plotly's bundled copy): put once at the top of an output
    whose charts come from `chart_html`."""
    return f"<script type='text/javascript'>{get_plotlyjs()}</script>"


def chart_html(chart: Chart) -> str:
    """The chart as a plotly div and its `Plotly.newPlot` call (plotly.js not included: see
    `plotlyjs_html`). A chart with no point to draw is its title and notes as text: an empty
    figure in a saved output tells a reader nothing more."""
    if not chart.points:
        notes = "".join(f"<div style='color:#666'>{html.escape(n)}</div>" for n in chart.notes)
        return (f"<div class='{CSS_CLASS}-empty' style='font:12px sans-serif'><b>{html.escape(chart.title)}</b>"
                f" ({html.escape(chart.y_title)}): <i>no data</i>{notes}</div>")
    return figure_html(figure(chart))


def figure_html(fig) -> str:
    """Any plotly figure as a div and its `Plotly.newPlot` call (plotly.js not included)."""
    div = pio.to_html(fig, include_plotlyjs=False, full_html=False, config=CONFIG)
    return f"<div class='{CSS_CLASS}'>{div}</div>"
