"""The articles' break-even curve for a split request, against what was measured (issue 43).

Moving a request's K/V from worker A to worker B costs `transfer_ms` once; over an
answer of n tokens that is transfer_ms / n per token. Decoding on B pays only where B's
time per output token beats A's by more than that. The seed article's example: 2 GiB of
K/V at 25 GB/s, about 86 ms, so B must be 0.67 ms/token faster for a 128-token answer and
0.17 ms/token for a 512-token one.

`break_even_figure` draws, with x = answer length (log scale), y = ms per output token:
- the article's curve, 86 / n, with its two quoted thresholds marked;
- one curve transfer_ms / n per prompt length measured (a longer prompt moves more K/V);
- one horizontal line per backlog on A: the measured advantage, A's ms per token (whole
  on A) minus B's (the split's decode half), the mean over that backlog's cases;
- one marker per case at (its answer length, its advantage): filled where the split was
  measured faster end to end than the whole request on A, a cross where it was not. The
  formula says "pays" where a marker sits above its prompt's curve.
Rows are `minivllm.bench.disaggregation` case rows (`measure_case`, or a committed
result file's "rows"), read for prompt_tokens, max_tokens, backlog, transfer_ms,
kv_bytes, advantage_ms_per_token, formula_says_split_pays and measured_split_pays.
"""

from __future__ import annotations

import math
import statistics

import plotly.graph_objects as go

ARTICLE_KV_BYTES = 2 * 2**30
ARTICLE_LINK_BYTES_PER_S = 25e9
ARTICLE_TRANSFER_MS = 86.0  # the article's rounding of 2 GiB / 25 GB/s (85.9 ms)
ARTICLE_ANSWERS = (128, 512)  # the answer lengths the article quotes thresholds for
ANSWERS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
CURVE_COLOURS = ["#4285f4", "#34a853", "#fbbc05", "#9c27b0", "#00acc1", "#795548"]
LINE_DASHES = ["dot", "dashdot", "longdash", "longdashdot"]


def break_even_ms_per_token(transfer_ms: float, answer_tokens: int) -> float:
    """How much faster per output token the decode side must be to repay the transfer."""
    return transfer_ms / answer_tokens


def transfer_by_prompt(rows: list[dict]) -> dict[int, dict]:
    """prompt length -> {"transfer_ms": median over its cases, "kv_bytes"}, ascending."""
    out = {}
    for p in sorted({r["prompt_tokens"] for r in rows}):
        cases = [r for r in rows if r["prompt_tokens"] == p and _finite(r.get("transfer_ms"))]
        if cases:
            out[p] = {"transfer_ms": statistics.median(r["transfer_ms"] for r in cases),
                      "kv_bytes": cases[0]["kv_bytes"]}
    return out


def advantage_by_backlog(rows: list[dict]) -> dict[int, float]:
    """backlog on A -> the mean measured advantage (ms per output token) over its cases."""
    out = {}
    for b in sorted({r["backlog"] for r in rows}):
        values = [r["advantage_ms_per_token"] for r in rows
                  if r["backlog"] == b and _finite(r.get("advantage_ms_per_token"))]
        if values:
            out[b] = statistics.fmean(values)
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _source_traces(rows: list[dict], label: str, answers: list[int], dash: str, first_colour: int,
                   dashes: list[str]) -> list:
    traces = []
    colours = {}  # prompt length -> its curve's colour, which its cases' markers take too
    for i, (p, t) in enumerate(transfer_by_prompt(rows).items()):
        colour = colours[p] = CURVE_COLOURS[(first_colour + i) % len(CURVE_COLOURS)]
        traces.append(go.Scatter(
            x=list(answers), y=[break_even_ms_per_token(t["transfer_ms"], n) for n in answers], mode="lines",
            name=f"{label}: transfer / n, {p}-token prompt ({t['kv_bytes'] / 1e6:.1f} MB in {t['transfer_ms']:.0f} ms)",
            line={"color": colour, "dash": dash},
            hovertemplate=f"{p}-token prompt: break-even %{{y:.3f}} ms/token at %{{x}} tokens<extra></extra>"))
    for i, (b, adv) in enumerate(advantage_by_backlog(rows).items()):
        traces.append(go.Scatter(
            x=[answers[0], answers[-1]], y=[adv, adv], mode="lines",
            name=f"{label}: advantage A − B, backlog {b} on A: {adv:.2f} ms/token",
            line={"color": "#444" if b == 0 else "#ea4335", "dash": dashes[i % len(dashes)], "width": 1.5},
            hovertemplate=f"backlog {b}: A − B = %{{y:.3f}} ms/token<extra></extra>"))
    cases = [r for r in rows if _finite(r.get("advantage_ms_per_token"))]
    for pays in (True, False):
        chosen = [r for r in cases if bool(r["measured_split_pays"]) is pays]
        if not chosen:
            continue
        traces.append(go.Scatter(
            x=[r["max_tokens"] for r in chosen], y=[r["advantage_ms_per_token"] for r in chosen],
            mode="markers+text", text=[f"b{r['backlog']}" for r in chosen], textposition="middle right",
            name=f"{label}: {'●' if pays else '✕'} split {'faster' if pays else 'not faster'} than whole on A "
                 "(measured; colour: its prompt's curve, bN: backlog N)",
            marker={"symbol": "circle" if pays else "x", "size": 11,
                    "color": [colours.get(r["prompt_tokens"], "#888") for r in chosen],
                    "line": {"width": 1, "color": "#222"}},
            customdata=[[r["prompt_tokens"], r["backlog"], "pays" if r["formula_says_split_pays"] else "does not pay",
                         r["transfer_ms"]] for r in chosen],
            hovertemplate=("prompt %{customdata[0]}, answer %{x}, backlog %{customdata[1]}<br>"
                           "advantage %{y:.3f} ms/token; transfer %{customdata[3]:.0f} ms<br>"
                           "formula: %{customdata[2]}<extra></extra>")))
    return traces


def break_even_figure(live_rows: list[dict], bench_rows: list[dict] | None = None, *,
                      article_ms: float = ARTICLE_TRANSFER_MS, answers=ANSWERS,
                      live_label: str = "live", bench_label: str = "committed run") -> go.Figure:
    """The curve, the measured advantages and verdicts: live rows, and a committed run's."""
    answers = sorted(answers)
    traces = [go.Scatter(
        x=answers, y=[break_even_ms_per_token(article_ms, n) for n in answers], mode="lines",
        name=f"article: 2 GiB at 25 GB/s = {article_ms:.0f} ms, / n", line={"color": "#222", "dash": "dash"},
        hovertemplate="article: break-even %{y:.3f} ms/token at %{x} tokens<extra></extra>")]
    quoted = [n for n in ARTICLE_ANSWERS if answers[0] <= n <= answers[-1]]
    traces.append(go.Scatter(
        x=quoted, y=[break_even_ms_per_token(article_ms, n) for n in quoted], mode="markers+text",
        name="the article's two thresholds", marker={"color": "#222", "size": 8},
        text=[f"{break_even_ms_per_token(article_ms, n):.2f} ms/token at {n}" for n in quoted],
        textposition=["top right" if n < answers[-1] / 2 else "top left" for n in quoted],
        hovertemplate="%{text}<extra></extra>"))
    traces += _source_traces(live_rows, live_label, answers, "solid", 0, LINE_DASHES[:2])
    if bench_rows:
        traces += _source_traces(bench_rows, bench_label, answers, "dot", 3, LINE_DASHES[2:])
    fig = go.Figure(data=traces)
    fig.update_layout(
        title={"text": "When does decoding elsewhere pay? Break-even = transfer / answer tokens", "font": {"size": 13}},
        # a log axis's range is in decades; a little past both ends so the end ticks show
        xaxis={"title": {"text": "answer length (output tokens)"}, "type": "log", "tickvals": answers,
               "range": [math.log10(answers[0]) - 0.03, math.log10(answers[-1]) + 0.03]},
        yaxis={"title": {"text": "ms per output token"}, "zeroline": True, "zerolinecolor": "#999"},
        height=640, template="plotly_white", margin={"l": 70, "r": 10, "t": 50},
        legend={"font": {"size": 10}, "orientation": "h", "yanchor": "top", "y": -0.15})
    return fig
