"""The divergence explorer: why two "identical" greedy runs part, on `minivllm.debug.compare`.

Pick a prompt and two settings (default: GEMM for every row vs the row-wise GEMV path),
press Run, and see both texts aligned token by token with the first split highlighted,
the top-1 margin per position for both sides, the top-k logits at any position (slider),
and how far apart each layer's residual stream already was at the split.

Compare runs inside the button's callback, on the kernel's thread, so every widget
update happens there too; it blocks the kernel for the few seconds it takes.
`report_html(report)` renders the same views statically (nbconvert, Kaggle commits).
"""

from __future__ import annotations

import html
import json

import ipywidgets as W

DEFAULT_A = {"gemv_max_rows": 0}
DEFAULT_B = {"gemv_max_rows": 4096}


def parse_options(text: str) -> dict:
    """'gemv_max_rows=0, batch_invariant=true' or a JSON object -> engine options."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        return json.loads(text)
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item.strip()!r}: expected KEY=VALUE, e.g. gemv_max_rows=0")
        try:
            out[key.strip()] = json.loads(value.strip())
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def tokens_html(report) -> str:
    """Both generations as token chips; shared tokens grey, the split and after coloured."""
    split = report.first_divergence.position if report.first_divergence else None

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
            out.append(f'<span title="pos {rec.position}, margin {tok.margin:.3f}" style="{style};margin:1px;'
                       f'padding:0 2px;white-space:pre">{html.escape(tok.text)}</span>')
        return "".join(out)

    head = ("<b>no divergence</b>" if split is None else
            f"<b>first divergence at generated token {split}</b> after {report.first_divergence.identical_chars} identical characters")
    return (f"<div style='font:12px monospace'>{head}<div><b>a</b> {html.escape(json.dumps(report.a_options))}</div>"
            f"<div style='line-height:1.9'>{chips('a')}</div><div><b>b</b> {html.escape(json.dumps(report.b_options))}</div>"
            f"<div style='line-height:1.9'>{chips('b')}</div></div>")


def _svg_lines(series: dict[str, list[float]], *, width: int = 520, height: int = 120, mark: int | None = None,
               title: str = "") -> str:
    colours = {"a": "#4285f4", "b": "#ea4335"}
    values = [v for s in series.values() for v in s]
    if not values:
        return ""
    top = max(values) or 1.0
    n = max(len(s) for s in series.values())
    x = lambda i: 5 + i / max(1, n - 1) * (width - 10)
    y = lambda v: height - 5 - v / top * (height - 15)
    lines = [f'<polyline fill="none" stroke="{colours.get(k, "#333")}" stroke-width="1.2" '
             f'points="{" ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(s))}"/>' for k, s in series.items()]
    if mark is not None:
        lines.append(f'<line x1="{x(mark):.1f}" x2="{x(mark):.1f}" y1="0" y2="{height}" stroke="#999" stroke-dasharray="3"/>')
    legend = " ".join(f'<span style="color:{colours.get(k, "#333")}">■ {k}</span>' for k in series)
    return (f"<div style='font:12px sans-serif'>{html.escape(title)} (max {top:.3g}) {legend}</div>"
            f'<svg width="{width}" height="{height}" style="background:#fafafa">{"".join(lines)}</svg>')


def margins_html(report) -> str:
    series = {side: [getattr(r, side).margin for r in report.records if getattr(r, side) is not None] for side in "ab"}
    split = report.first_divergence.position if report.first_divergence else None
    return _svg_lines(series, mark=split, title="top-1 minus top-2 logit per generated token (small = a near-tie)")


def layers_html(report) -> str:
    if not report.layer_diffs:
        return "<i>no divergence: no layer table</i>"
    series = {"a": [d.prefix_rel_l2 for d in report.layer_diffs], "b": [d.at_split_rel_l2 for d in report.layer_diffs]}
    chart = _svg_lines(series, title="relative L2 of b vs a per layer: a = over the whole prefix (the KV cache), "
                                     "b = at the split row")
    rows = "".join(f"<tr><td>{html.escape(d.layer)}</td><td>{d.prefix_rel_l2:.2e}</td><td>{d.at_split_rel_l2:.2e}</td>"
                   f"<td>{'' if d.first_differing_position is None else d.first_differing_position}</td></tr>"
                   for d in report.layer_diffs)
    return (chart + "<table style='font:11px monospace'><tr><th>layer</th><th>prefix rel L2</th><th>split rel L2</th>"
            f"<th>first differing position</th></tr>{rows}</table>")


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
        rows = "".join(f"<tr><td>{html.escape(repr(t.text))}</td><td>{t.token_id}</td><td>{t.logit:.4f}</td></tr>" for t in tok.top)
        cols.append(f"<td style='vertical-align:top'><b>{side}</b> chose {html.escape(repr(tok.text))} "
                    f"(margin {tok.margin:.4f})<table style='font:11px monospace'>{rows}</table></td>")
    return f"<div>top-k logits at generated token {position}</div><table><tr>{''.join(cols)}</tr></table>"


def report_html(report, position: int | None = None) -> str:
    """Every view of one report as static HTML."""
    if position is None:
        position = report.first_divergence.position if report.first_divergence else 0
    return tokens_html(report) + margins_html(report) + topk_html(report, position) + layers_html(report)


class DivergenceExplorer:
    def __init__(self, llm=None, prompt: str = "Once upon a time, in a village at the edge of a great forest, there lived",
                 a: dict | None = None, b: dict | None = None, *, model: str = "smollm2-135m", max_tokens: int = 96):
        self.llm = llm
        self.report = None
        self.model = W.Text(value=model, description="model")
        self.prompt = W.Textarea(value=prompt, layout=W.Layout(width="100%"))
        self.a = W.Text(value=", ".join(f"{k}={json.dumps(v)}" for k, v in (a or DEFAULT_A).items()), description="a")
        self.b = W.Text(value=", ".join(f"{k}={json.dumps(v)}" for k, v in (b or DEFAULT_B).items()), description="b")
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=2048, description="max tokens")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.status = W.HTML()
        self.tokens, self.margins, self.layers, self.topk = W.HTML(), W.HTML(), W.HTML(), W.HTML()
        self.position = W.IntSlider(value=0, min=0, max=0, description="position", continuous_update=False)
        self.run_button.on_click(lambda _: self.run())
        self.position.observe(lambda change: self._show_position(change["new"]), names="value")
        self.widget = W.VBox([W.HBox([self.model, self.max_tokens]), self.prompt, W.HBox([self.a, self.b]),
                              W.HBox([self.run_button, self.status]), self.tokens, self.margins,
                              self.position, self.topk, self.layers])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def run(self):
        from minivllm.debug import compare
        from minivllm.errors import MinivllmError

        self.status.value = "running…"
        try:
            a, b = parse_options(self.a.value), parse_options(self.b.value)
            target = self.llm if self.llm is not None else self.model.value.strip()
            self.report = compare(target, self.prompt.value, a=a, b=b, max_tokens=self.max_tokens.value)
        except (MinivllmError, ValueError) as exc:
            self.status.value = f"<span style='color:#c00'>{html.escape(str(exc))}</span>"
            return None
        self.status.value = "done"
        return self.show(self.report)

    def show(self, report):
        """Draw an existing report (from `compare`, or loaded) without running it again."""
        self.report = report
        self.tokens.value = tokens_html(report)
        self.margins.value = margins_html(report)
        self.layers.value = layers_html(report)
        split = report.first_divergence.position if report.first_divergence else 0
        self.position.max = max(0, len(report.records) - 1)
        self.position.value = split
        self._show_position(split)
        return report

    def _show_position(self, position: int) -> None:
        if self.report is not None:
            self.topk.value = topk_html(self.report, position)
