"""The static fallback of a `chart_data.Chart`: inline SVG, for places that run no
JavaScript (nbconvert, a Kaggle "Save & Run All" commit, a static viewer).

Plotly writes static images only through kaleido, which drives a Chrome it must find or
download at export time; a Kaggle commit has neither a browser nor the network, so the
fallback draws the same `Chart` data (the numbers the live plotly figure shows) as SVG.
Gaps (None) split a line; no point is ever NaN or infinite (chart_data drops them).
"""

from __future__ import annotations

import html
import math
import time

from minivllm_widgets.charts import PALETTE

WIDTH, HEIGHT = 560, 150
LEFT, RIGHT, TOP, BOTTOM = 64, 8, 8, 18
_TEXT = 'font-size="10" fill="#555" font-family="sans-serif"'


def _label(value: float, log: bool) -> str:
    return f"{value:.2g}" if log else f"{value:.4g}"


def _x_label(chart, v) -> str:
    if chart.time_x:
        return time.strftime("%H:%M:%S", time.localtime(v))
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def chart_svg(chart, width: int = WIDTH, height: int = HEIGHT) -> str:
    """The chart as a titled inline SVG with labelled axes and a legend."""
    notes = "".join(f"<div style='color:#666'>{html.escape(n)}</div>" for n in chart.notes)
    head = f"<div style='font:12px sans-serif'><b>{html.escape(chart.title)}</b> ({html.escape(chart.y_title)})"
    ys = [v for s in chart.series for v in s.y if v is not None and (v > 0 or not chart.y_log)]
    if not ys:
        return f"{head}: <i>no data</i>{notes}</div>"
    categorical = any(isinstance(x, str) for s in chart.series for x in s.x)
    if categorical:
        labels = list(dict.fromkeys(x for s in chart.series for x in s.x))
        xpos = {x: i for i, x in enumerate(labels)}
        lo_x, hi_x = 0.0, float(max(1, len(labels) - 1))
    else:
        xs = [x for s in chart.series for x in s.x]
        lo_x, hi_x = chart.x_range if chart.x_range is not None else (min(xs), max(xs))
    span_x = (hi_x - lo_x) or 1.0
    f = (lambda v: math.log10(v)) if chart.y_log else (lambda v: v)
    lo_y = min(f(v) for v in ys) if chart.y_log else min(0.0, min(ys))
    hi_y = max(f(v) for v in ys)
    span_y = (hi_y - lo_y) or 1.0
    plot_w, plot_h = width - LEFT - RIGHT, height - TOP - BOTTOM

    def px(x) -> float:
        return LEFT + ((xpos[x] if categorical else x) - lo_x) / span_x * plot_w

    def py(y) -> float:
        return TOP + plot_h - (f(y) - lo_y) / span_y * plot_h

    parts = [f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#bbb"/>',
             f'<line x1="{LEFT}" x2="{width - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" stroke="#bbb"/>']
    for frac in (0.0, 0.5, 1.0):  # three y ticks, never repeated
        value = lo_y + frac * span_y
        shown = 10 ** value if chart.y_log else value
        y = TOP + plot_h - frac * plot_h
        parts.append(
            f'<text x="{LEFT - 4}" y="{y + 3:.1f}" text-anchor="end" {_TEXT}>{_label(shown, chart.y_log)}</text>'
        )
    ends = (labels[0], labels[-1]) if categorical else (lo_x, hi_x)
    parts.append(f'<text x="{LEFT}" y="{height - 4}" {_TEXT}>{html.escape(_x_label(chart, ends[0]))}</text>')
    parts.append(f'<text x="{width - RIGHT}" y="{height - 4}" text-anchor="end" {_TEXT}>'
                 f'{html.escape(_x_label(chart, ends[1]))}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.1f}" y="{height - 4}" text-anchor="middle" {_TEXT}>'
                 f'{html.escape(chart.x_title)}</text>')
    for i, s in enumerate(chart.series):
        colour = PALETTE[i % len(PALETTE)]
        segment: list[str] = []
        for x, y in list(zip(s.x, s.y)) + [(None, None)]:
            if y is None or (chart.y_log and y <= 0):
                if segment:
                    parts.append(
                        f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(segment)}"/>'
                        if len(segment) > 1
                        else '<circle r="2" fill="{}" cx="{}" cy="{}"/>'.format(colour, *segment[0].split(",")[:2])
                    )
                segment = []
                continue
            segment.append(f"{px(x):.1f},{py(y):.1f}")
    if chart.mark_x is not None:
        x = px(chart.mark_x)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP}" y2="{TOP + plot_h}" stroke="#999" stroke-dasharray="3"/>'
            f'<text x="{x + 3:.1f}" y="{TOP + 9}" {_TEXT}>{html.escape(chart.mark_label)}</text>'
        )
    legend = " ".join(f'<span style="color:{PALETTE[i % len(PALETTE)]}">■ {html.escape(s.name)}</span>'
                      for i, s in enumerate(chart.series))
    return (f"{head} {legend}{notes}</div><svg class='minivllm-static-chart' width='{width}' height='{height}' "
            f"style='background:#fafafa'>{''.join(parts)}</svg>")
