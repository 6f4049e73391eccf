"""The divergence explorer's views as HTML: the summary, the token chips, the top-k table,
and the static charts (the live charts' plotly figures as HTML). The widget shows the same
HTML around live plotly figures; `report_html(report)` is all of it, plotly.js included once,
for places without widgets (nbconvert, Kaggle commits).
"""

from __future__ import annotations

import html
import json

from minivllm.debug.divergence_report import token_number
from minivllm_widgets.chart_data import layer_chart, margin_chart
from minivllm_widgets.divergence_story import (
    is_tie,
    margin_words,
    starting_position,
    summary_sentence,
    tie_words,
)
from minivllm_widgets.static_charts import chart_html, plotlyjs_html

FOLD_AFTER = 40  # shared tokens shown before the rest fold into a count
KEEP_BEFORE_SPLIT = 12  # shared tokens kept visible just before the split


def _tok(text: str) -> str:
    """A token's text with its whitespace visible."""
    return html.escape(text).replace("\n", "↵<br>").replace("\t", "⇥") or "∅"


def _side_words(settings: dict) -> str:
    if "engine" not in settings:  # a report from before sides had engines
        return "minivllm"
    return f"{settings['engine']} on {settings.get('device')}, {settings.get('dtype')}"


def summary_html(report) -> str:
    ran = (f"{report.model} on {report.device}, {report.activation_dtype} activations; "
           f"a: {_side_words(report.a_settings)}; b: {_side_words(report.b_settings)}")
    return (f"<div class='minivllm-divergence-summary' style='font:13px sans-serif;margin:4px 0 8px;padding:6px;"
            f"background:#f1f3f4;border-left:3px solid #4285f4'>{html.escape(summary_sentence(report))}"
            f"<div style='color:#666;font-size:11px'>{html.escape(ran)}</div></div>")


def _chip(rec, tok, style: str) -> str:
    # Chips touch (no margin, no padding): the pieces of one word read as one word; a thin
    # inset line marks where one token ends, and the hover names the token and its margin.
    return (f'<span class="minivllm-chip" title="generated token {token_number(rec.position)}: {margin_words(tok)}" '
            f'style="{style};display:inline;margin:0;padding:0;white-space:pre-wrap;'
            f'word-break:break-all;box-shadow:inset -1px 0 0 rgba(0,0,0,0.18)">{_tok(tok.text)}</span>')


def tokens_html(report) -> str:
    """Both generations as token chips that wrap: the shared prefix grey (folded with a
    count when long), the split red, what follows light red."""
    fd = report.first_divergence
    split = fd.position if fd else None
    shared_n = split if split is not None else len(report.records)

    def chips(side: str) -> str:
        out = []
        for rec in report.records:
            tok = getattr(rec, side)
            if tok is None:
                break
            style = "background:#eee"
            if split is not None and rec.position == split:
                style = "background:#ea4335;color:white;font-weight:bold"
            elif split is not None and rec.position > split:
                style = "background:#fde0dc"
            out.append(_chip(rec, tok, style))
        return "".join(out)

    def after_split(side: str) -> str:
        out = []
        for rec in report.records[shared_n:]:
            tok = getattr(rec, side)
            if tok is None:
                out.append("<i> (ended)</i>")
                break
            out.append(_chip(rec, tok, "background:#ea4335;color:white;font-weight:bold" if rec.position == split
                             else "background:#fde0dc"))
        return "".join(out)

    shared = [_chip(r, r.a, "background:#eee") for r in report.records[:shared_n] if r.a is not None]
    if len(shared) > FOLD_AFTER:
        folded = len(shared) - KEEP_BEFORE_SPLIT
        prefix = (f"<details style='display:inline'><summary style='display:inline;cursor:pointer;color:#1a73e8'>"
                  f"[{folded} shared tokens folded: show]</summary>{''.join(shared[:folded])}</details>"
                  + "".join(shared[folded:]))
    else:
        prefix = "".join(shared)
    if split is None:
        head = f"<b>no divergence</b>: both sides generated the same {len(report.a_token_ids)} tokens"
        body = f"<div style='line-height:1.9'>{prefix}</div>"
    else:
        head = (
            f"<b>first divergence at generated token {token_number(split)}</b> "
            f"after {fd.identical_tokens} identical tokens "
            f"({fd.identical_chars} characters)"
        )
        body = (f"<div><b>shared</b> ({shared_n} tokens)</div><div style='line-height:1.9'>{prefix}</div>"
                f"<div><b>a</b> {html.escape(_opts_text(report.a_options))}</div>"
                f"<div style='line-height:1.9'>{after_split('a')}</div>"
                f"<div><b>b</b> {html.escape(_opts_text(report.b_options))}</div>"
                f"<div style='line-height:1.9'>{after_split('b')}</div>")
    return f"<div class='minivllm-tokens' style='font:12px monospace;max-width:100%'>{head}{body}</div>"


def _opts_text(options: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()) or "(the model's defaults)"


def margins_html(report) -> str:
    return chart_html(margin_chart(report))


def layer_note_html(report) -> str:
    """The layer table's note and where b first leaves a (shown above the chart)."""
    note = getattr(report, "layer_note", None)
    out = f"<div style='font:12px sans-serif;color:#555'>{html.escape(note)}</div>" if note else ""
    left = getattr(report, "first_layer_difference", None)
    if left is not None:
        out += (f"<div class='minivllm-first-leave' style='font:12px sans-serif'><b>b first leaves a at "
                f"{html.escape(left['layer'])}, sequence position {left['position']}</b> "
                f"({'a prompt token' if left['in_prompt'] else 'a generated token'})</div>")
    return out


def no_layers_words(report) -> str:
    if report.first_divergence is None:
        return "no divergence and no layer replay: no layer table"
    return ("no layer table: the per-layer replay did not run for this report (compare(..., hidden_states=False), "
            "or a side that records logits only)")


def layer_table_html(report) -> str:
    rows = "".join(f"<tr><td>{html.escape(d.layer)}</td><td>{d.prefix_rel_l2:.2e}</td><td>{d.at_split_rel_l2:.2e}</td>"
                   f"<td>{'' if d.first_differing_position is None else d.first_differing_position}</td></tr>"
                   if getattr(d, "comparable", True) else
                   f"<tr><td>{html.escape(d.layer)}</td><td colspan=3>not comparable (see the note)</td></tr>"
                   for d in report.layer_diffs)
    return ("<table style='font:11px monospace'><tr><th>after</th><th>whole prefix, rel L2</th>"
            "<th>split row, rel L2</th><th>first differing sequence position</th></tr>" + rows + "</table>")


def layers_html(report) -> str:
    """The static layer view: note, chart (plotly, plotly.js not included) and table."""
    if not report.layer_diffs:
        return layer_note_html(report) or f"<i>{html.escape(no_layers_words(report))}</i>"
    chart = layer_chart(report)
    return layer_note_html(report) + (chart_html(chart) if chart is not None else "") + layer_table_html(report)


def topk_html(report, position: int) -> str:
    rec = next((r for r in report.records if r.position == position), None)
    if rec is None:
        return "<i>no such position</i>"
    cols = []
    for side in "ab":
        tok = getattr(rec, side)
        if tok is None:
            cols.append(f"<td><b>{side}</b>: ended</td>")
            continue
        rows = "".join(
            f"<tr><td>{html.escape(repr(t.text))}</td><td>{t.token_id}</td><td>{t.logit:.4f}</td></tr>" for t in tok.top
        )
        how = (f"<br><b>{html.escape(tie_words(tok))}</b>" if is_tie(tok) else f" ({html.escape(margin_words(tok))})")
        cols.append(
            f"<td style='vertical-align:top'><b>{side}</b> chose {html.escape(repr(tok.text))}{how}"
            f"<table style='font:11px monospace'><tr><th>text</th><th>id</th><th>logit</th></tr>{rows}</table></td>"
        )
    return f"<div>top-k logits at generated token {token_number(position)}</div><table><tr>{''.join(cols)}</tr></table>"


def report_html(report, position: int | None = None) -> str:
    """Every view of one report as static HTML that draws its charts offline (plotly.js
    inline, once: see static_charts)."""
    if position is None:
        position = starting_position(report)
    return (
        plotlyjs_html()
        + summary_html(report)
        + tokens_html(report)
        + margins_html(report)
        + topk_html(report, position)
        + layers_html(report)
    )
