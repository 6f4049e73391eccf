"""HTML for each panel's view model. The live widgets and the static fallback (nbconvert,
Kaggle "Save & Run All") use the same functions, so both show the same thing."""

from __future__ import annotations

import html

from minivllm_widgets.chart_data import dashboard_charts
from minivllm_widgets.page_grid import COLOURS, LEGEND
from minivllm_widgets.page_map_figure import page_map_figure
from minivllm_widgets.static_charts import chart_html, figure_html, plotlyjs_html

_TABLE = "border-collapse:collapse;font:12px monospace"
_CELL = "padding:2px 6px;border-bottom:1px solid #ddd;text-align:left"


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f'<th style="{_CELL}">{html.escape(h)}</th>' for h in header)
    body = "".join("<tr>" + "".join(f'<td style="{_CELL}">{c}</td>' for c in row) + "</tr>" for row in rows)
    return f'<table style="{_TABLE}"><tr>{head}</tr>{body}</table>'


def _bar(fraction: float, colour: str = "#4285f4", width: int = 80) -> str:
    w = int(max(0.0, min(1.0, fraction)) * width)
    return (f'<span style="display:inline-block;width:{width}px;height:8px;background:#eee">'
            f'<span style="display:block;width:{w}px;height:8px;background:{colour}"></span></span>')


def _fmt(v, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)


def _secs(v) -> str:
    """Seconds with a unit, 3 significant digits (0.000123 -> '123 µs')."""
    if v is None:
        return "–"
    if abs(v) < 1e-3:
        return f"{v * 1e6:.3g} µs"
    if abs(v) < 1:
        return f"{v * 1e3:.3g} ms"
    return f"{v:.3g} s"


def queues_html(view: dict) -> str:
    parts = []
    for name, w in view.items():
        counts = {
            q: sum(r["queue"] == q for r in w["requests"]) for q in ("running", "waiting", "preempted", "finished")
        }
        title = (f"<b>{html.escape(name)}</b> ({html.escape(w['device'])}, {html.escape(w['state'])}): "
                 f"{counts['running']} running, {counts['waiting']} waiting, {counts['preempted']} preempted"
                 + (f", {counts['finished']} just finished" if counts["finished"] else ""))
        rows = [[html.escape(r["id"]), r["queue"], r["phase"],
                 _bar(r["progress"], "#34a853" if r["phase"] == "decode" else "#4285f4") + f" {r['progress']:.0%}",
                 str(r["prompt_tokens"]), str(r["restored_tokens"]), str(r["output_tokens"]), str(r["flight"] or "")]
                for r in w["requests"][:24]]
        more = f"<div>… {len(w['requests']) - 24} more</div>" if len(w["requests"]) > 24 else ""
        table = (_table(["request", "queue", "phase", "progress", "prompt", "restored", "output", "flight"], rows)
                 if rows else "<div><i>idle: no request running or waiting</i></div>")
        parts.append(f"<div style='margin-bottom:8px'><div>{title}</div>{table}{more}</div>")
    return "".join(parts) or "<i>no workers</i>"


def kv_caption_html(name: str, w: dict | None) -> str:
    if w is None:
        return f"<b>{html.escape(name)}</b>: no snapshot yet (the worker is starting or restarting)"
    counts = ", ".join(f'<span class="minivllm-kv-count" data-state="{s}">{w["counts"].get(s, 0)} {s}</span>'
                       for s in COLOURS)
    hit = f"{w['hits']}/{w['lookups']} prefix hits, {w['restored_tokens']} tokens restored"
    flights = f", {w['flights']} open flights" if w["flights"] else ""
    return (f"<b>{html.escape(name)}</b>: {w['total']} pages of {w['page_size']} tokens ({counts}); "
            f"{hit}{flights}")


def kv_legend_html() -> str:
    swatches = "".join(
        f'<span style="display:inline-block;width:10px;height:10px;background:rgb{c};margin:0 4px 0 10px">'
        f"</span>{html.escape(LEGEND[s])}"
        for s, c in COLOURS.items()
    )
    return f"<div style='font:12px sans-serif'>{swatches}</div>"


def kv_static_html(view: dict, *, plotlyjs: bool = True) -> str:
    """Per worker: the caption, then the page map as a plotly heatmap (hover as the live map's).
    A whole output on its own unless `plotlyjs=False` (an output that already starts with
    `static_charts.plotlyjs_html()`, as `Workbench.static_html` does)."""
    parts = [plotlyjs_html()] if plotlyjs else []
    parts.append(kv_legend_html())
    for name, w in view.items():
        parts.append(f"<div>{kv_caption_html(name, w)}</div>")
        if w is not None:
            parts.append(figure_html(page_map_figure(w["codes"], w.get("owners"))))
    return "".join(parts)


def router_html(view: dict) -> str:
    rows = []
    for d in reversed(view["decisions"]):
        cells = []
        for c in d["candidates"]:
            mark = "✔ " if c["worker"] == d["chosen"] else ""
            state = "" if c["healthy"] else " (down)"
            cells.append(f"{mark}{html.escape(c['worker'])}{state}: {c['active']} active / {c['queued']} queued, "
                         f"cached {c['cached']} tokens, prefill {_secs(c['prefill_s'])} + decode {_secs(c['decode_s'])}"
                         f" (finish {_secs(c['finish_s'])}) → <b>{_secs(c['score'])}</b>")
        for c in d.get("splits", []):
            mark = "✔ " if d.get("split") == {"prefill": c["prefill"], "decode": c["decode"]} else ""
            cells.append(f"{mark}{html.escape(c['prefill'])} → {html.escape(c['decode'])}: prefill "
                         f"{_secs(c['prefill_s'])} + transfer {_secs(c['transfer_s'])} "
                         f"({c['transfer_bytes'] / 1e6:.3g} MB at {c['link_mb_per_s']:.3g} MB/s) + decode until "
                         f"{_secs(c['decode_s'])} → <b>{_secs(c['score'])}</b> "
                         f"(break-even {c['break_even_ms_per_token']:.3g} ms/token)")
        rows.append(
            [html.escape(d["request_id"]), html.escape(d["reason"]), "<br>".join(cells), html.escape(d["chosen"])]
        )
    table = _table(["request", "reason", "candidates (score = max(prefill + decode, finish), seconds; lowest wins)",
                    "chosen"], rows)
    return f"<div>router: <b>{html.escape(view['policy'])}</b></div>" + (table if rows else "<i>no decisions yet</i>")


def speculative_html(view: dict) -> str:
    parts = []
    for name, s in view.items():
        if s is None:
            parts.append(f"<div><b>{html.escape(name)}</b>: no draft model</div>")
            continue
        bars = "".join(
            f'<span title="round: {a}/{p} accepted" style="display:inline-block;width:4px;margin-right:1px;'
            f'height:{4 + 24 * (a / p if p else 0):.0f}px;background:#34a853;vertical-align:bottom"></span>'
            for p, a in s["recent"])
        hist = ", ".join(f"k={k}: {n}" for k, n in sorted(s["histogram"].items(), key=lambda kv: int(kv[0])))
        parts.append(f"<div><b>{html.escape(name)}</b>: acceptance {s['acceptance_rate']:.1%} "
                     f"({s['accepted']}/{s['proposed']}); draft lengths {hist or '–'}<br>{bars}</div>")
    return "".join(parts)


def headline_html(rows: tuple) -> str:
    """One line of large figures per worker (panel_state.headline_view)."""
    big = "font:600 18px sans-serif;margin-right:4px"
    parts = []
    for name, state, running, waiting, rate, used, hits in rows:
        cells = [f"<b>{html.escape(name)}</b> <span style='color:#666'>{html.escape(state)}</span>"]
        if running is not None:
            cells += [f"<span style='{big}'>{running}</span>running", f"<span style='{big}'>{waiting}</span>waiting",
                      f"<span style='{big}'>{_fmt(rate, '.1f')}</span>decode tok/s",
                      f"<span style='{big}'>{used:.0%}</span>KV in use",
                      f"<span style='{big}'>{hits[0]}/{hits[1]}</span>prefix hits"]
        parts.append("<div style='display:flex;gap:18px;align-items:baseline;font:12px sans-serif'>"
                     + "".join(f"<span>{c}</span>" for c in cells) + "</div>")
    return "".join(parts) or "<i>no workers</i>"


def throughput_static_html(throughput: dict, step_ms: dict) -> str:
    """The dashboard's two time series (decode tok/s, step latency) over their shared
    window: the live charts' plotly figures as HTML (plotly.js not included: the output
    that holds them starts with `static_charts.plotlyjs_html()`)."""
    return "".join(chart_html(c) for c in dashboard_charts(throughput, step_ms))
