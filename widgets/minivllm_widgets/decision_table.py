"""The cost+split router's decision for one request as the articles' score table: every
whole-request candidate and every "prefill here, decode there" candidate with its terms,
the chosen row marked (issue 43).

Reads a decision record (`stream.decision`, or `cluster.snapshot()["router"]["decisions"]`):
"chosen", "split" (None or {"prefill", "decode"}), "reason", "candidates" (router.py's
Candidate fields: worker, active, queued, prefill_s, decode_s, score) and
"split_candidates" (split_pricing.py's SplitCandidate: prefill, decode, transfer_bytes,
prefill_s, transfer_s, decode_s, score, break_even_ms_per_token).

HTML, not a plotly table: the table holds text and numbers a reader copies, and a chart
of it would say nothing more.
"""

from __future__ import annotations

import html

from minivllm.serving.split_pricing import SPLIT_MARGIN

HEADER = ["candidate", "active / queued", "prefill s", "transfer s (MB)", "decode s", "score s",
          "break-even ms/token"]
_TABLE = "border-collapse:collapse;font:12px monospace"
_CELL = "padding:2px 8px;border-bottom:1px solid #ddd;text-align:left"
_CHOSEN = "background:#e6f4ea;font-weight:bold"


def _num(v, spec: str = ".3f") -> str:
    return "–" if v is None else format(v, spec)


def decision_rows(decision: dict) -> list[dict]:
    """One row per candidate, whole ones first: {"cells": [...], "chosen": bool}."""
    split = decision.get("split")
    rows = []
    for c in decision.get("candidates") or []:
        rows.append({"cells": [f"whole on {c['worker']}", f"{c['active']} / {c['queued']}", _num(c.get("prefill_s")),
                               "–", _num(c.get("decode_s")), _num(c.get("score")), "–"],
                     "chosen": not split and c["worker"] == decision.get("chosen")})
    for s in decision.get("split_candidates") or []:
        chosen = bool(split) and (split["prefill"], split["decode"]) == (s["prefill"], s["decode"])
        rows.append({"cells": [f"prefill {s['prefill']} → decode {s['decode']}", "", _num(s["prefill_s"]),
                               f"{s['transfer_s']:.4f} ({s['transfer_bytes'] / 1e6:.1f})", _num(s["decode_s"]),
                               _num(s["score"]), _num(s.get("break_even_ms_per_token"), ".4f")],
                     "chosen": chosen})
    return rows


def decision_table_html(decision: dict, title: str = "") -> str:
    """The table, with the router's reason under it; the chosen candidate highlighted."""
    head = "".join(f'<th style="{_CELL}">{html.escape(h)}</th>' for h in HEADER)
    body = "".join(
        f'<tr class="minivllm-decision-row" style="{_CHOSEN if r["chosen"] else ""}">'
        + "".join(f'<td style="{_CELL}">{html.escape(c)}</td>' for c in r["cells"]) + "</tr>"
        for r in decision_rows(decision))
    caption = f"<div><b>{html.escape(title)}</b></div>" if title else ""
    reason = html.escape(str(decision.get("reason", "")))
    return (f"<div class='minivllm-decision-table'>{caption}<table style='{_TABLE}'><tr>{head}</tr>{body}</table>"
            f"<div style='font:12px sans-serif;color:#555;margin-top:4px'>router: {reason} "
            "(highlighted: the candidate it chose; lowest score wins, a split only below "
            f"{SPLIT_MARGIN}× the best whole score)</div></div>")
