"""The divergence explorer: why two "identical" greedy runs part, on `minivllm.debug.compare`.

Pick a prompt and two sides (default: GEMM for every row vs the row-wise GEMV path),
press Run, and see both texts aligned token by token with the first split highlighted,
the top-1 margin per position for both sides, the top-k logits at any position (slider),
and how far apart each layer's residual stream already was at the split. Each side is
an engine (minivllm; transformers, the float32 reference; llama.cpp where it imports),
and for minivllm its engine options, device and activation dtype (blank: the model's).

Compare runs inside the button's callback, on the kernel's thread, so every widget
update happens there too; it blocks the kernel for the few seconds it takes.
`report_html(report)` renders the same views statically (nbconvert, Kaggle commits).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import ipywidgets as W

DEFAULT_A = {"gemv_max_rows": 0}
DEFAULT_B = {"gemv_max_rows": 4096}


def parse_options(text: str, side: str = "options") -> dict:
    """'gemv_max_rows=0, batch_invariant=true' or a JSON object -> engine options, names
    checked (the engine's one parser, engine/options.py)."""
    from minivllm.engine.options import parse_overrides

    return parse_overrides(text, side)


SAME = ""  # a device/dtype choice that keeps the model's


def engine_choices() -> list[str]:
    """The engines a side can be: minivllm and transformers, and llama.cpp when it imports."""
    import importlib.util

    out = ["minivllm", "transformers"]
    if importlib.util.find_spec("llama_cpp") is not None:
        out.append("llama.cpp")
    return out


def device_choices() -> list[tuple[str, str]]:
    import torch

    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return [("the model's", SAME), ("cpu", "cpu")] + [(d, d) for d in cuda]


DTYPE_CHOICES = [("the model's", SAME), ("f32", "f32"), ("f16", "f16"), ("bf16", "bf16")]


def side_spec(engine: str, options_text: str = "", device: str = SAME, dtype: str = SAME, side: str = "options"):
    """The form's fields for one side -> what `compare` takes for it."""
    if engine == "llama.cpp":
        return "llama.cpp"
    if engine == "transformers":
        return {"engine": "transformers", **({"device": device} if device else {})}
    spec = parse_options(options_text, side)
    if device:
        spec["device"] = device
    if dtype:
        spec["dtype"] = dtype
    return spec


def split_side(spec) -> tuple[str, dict, str, str]:
    """`compare`'s side (a dict or an engine name) -> (engine, engine options, device, dtype) for the form."""
    if isinstance(spec, str):
        return spec, {}, SAME, SAME
    spec = dict(spec or {})
    engine = spec.pop("engine", "minivllm")
    return engine, spec, str(spec.pop("device", SAME)), str(spec.pop("dtype", SAME))


TIE_RULE = "greedy argmax takes the lowest token id among equal logits (torch.argmax returns the first maximum)"
FOLD_AFTER = 40  # shared tokens shown before the rest fold into a count
KEEP_BEFORE_SPLIT = 12  # shared tokens kept visible just before the split


def _tok(text: str) -> str:
    """A token's text with its whitespace visible."""
    return html.escape(text).replace("\n", "↵<br>").replace("\t", "⇥") or "∅"


def _is_tie(tok) -> bool:
    return tok is not None and tok.margin == 0.0


def _tie_words(tok) -> str:
    """'an exact tie between ' ... ' (ids 5 and 9), broken by the rule'."""
    if len(tok.top) < 2:
        return "an exact tie"
    first, second = tok.top[0], tok.top[1]
    return (f"an exact tie between {first.text!r} (id {first.token_id}) and {second.text!r} (id {second.token_id}) "
            f"at logit {first.logit:.4f}, broken by the rule: {TIE_RULE}")


def _choice_words(side: str, tok) -> str:
    if tok is None:
        return f"side {side} has already ended"
    second = tok.top[1].text if len(tok.top) > 1 else None
    if _is_tie(tok):
        return f"side {side} picks {tok.text!r} in {_tie_words(tok)}"
    return (f"side {side} picks {tok.text!r} by a margin of {tok.margin:.4g} logits"
            + (f" over {second!r}" if second is not None else ""))


def summary_sentence(report) -> str:
    """The report in plain words, one or two sentences (the explorer's first line)."""
    fd = report.first_divergence
    if fd is None:
        n = len(report.a_token_ids)
        close = min((r for r in report.records if r.a is not None), key=lambda r: r.a.margin, default=None)
        out = f"The runs agree on all {n} generated tokens: no divergence."
        if close is not None:
            out += (f" The closest call was token {close.position + 1} ({close.a.text!r}), "
                    + (_tie_words(close.a) if _is_tie(close.a) else f"a margin of {close.a.margin:.4g} logits") + ".")
        left = getattr(report, "first_layer_difference", None)
        if left is not None:
            out += (f" Their hidden states still differ: b first leaves a at {left['layer']}, sequence position "
                    f"{left['position']} ({'in the prompt' if left['in_prompt'] else 'a generated token'}).")
        return out
    rec = report.records[fd.position]
    out = (f"The runs agree for {fd.identical_tokens} tokens; at token {fd.position + 1} "
           f"{_choice_words('a', rec.a)}, while {_choice_words('b', rec.b)}.")
    first = next((d for d in report.layer_diffs if d.first_differing_position is not None), None)
    if first is not None:
        split_row = fd.sequence_position - 1  # the row whose logits chose the diverging token
        where = (f"the hidden states already differed from {first.layer} at position {first.first_differing_position}"
                 f" (of {len(report.prompt_token_ids)} prompt tokens)")
        if first.first_differing_position < split_row:
            out += f" {where[0].upper()}{where[1:]}, and that difference was in the KV cache before the split."
        else:
            out += f" {where[0].upper()}{where[1:]}: the difference arose at the split row itself."
    elif report.layer_diffs:
        out += " The hidden states were identical up to the split row: only the final logits differed."
    return out


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
    tie = " (an exact tie)" if _is_tie(tok) else ""
    return (f'<span class="minivllm-chip" title="token {rec.position + 1}, margin {tok.margin:.4g} logits{tie}" '
            f'style="{style};display:inline-block;margin:1px;padding:0 2px;white-space:pre-wrap;'
            f'word-break:break-all;border-radius:2px">{_tok(tok.text)}</span>')


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
        head = (f"<b>first divergence at generated token {split + 1}</b> after {fd.identical_tokens} identical tokens "
                f"({fd.identical_chars} characters)")
        body = (f"<div><b>shared</b> ({shared_n} tokens)</div><div style='line-height:1.9'>{prefix}</div>"
                f"<div><b>a</b> {html.escape(_opts_text(report.a_options))}</div>"
                f"<div style='line-height:1.9'>{after_split('a')}</div>"
                f"<div><b>b</b> {html.escape(_opts_text(report.b_options))}</div>"
                f"<div style='line-height:1.9'>{after_split('b')}</div>")
    return f"<div class='minivllm-tokens' style='font:12px monospace;max-width:100%'>{head}{body}</div>"


def _opts_text(options: dict) -> str:
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()) or "(the model's defaults)"


def _svg_lines(series: dict[str, list[float]], *, width: int = 520, height: int = 120, mark: int | None = None,
               title: str = "", unit: str = "", x_label: str = "") -> str:
    palette = ["#4285f4", "#ea4335", "#34a853"]
    values = [v for s in series.values() for v in s]
    if not values:
        return ""
    top = max(values) or 1.0
    n = max(len(s) for s in series.values())
    left = 44
    x = lambda i: left + i / max(1, n - 1) * (width - left - 5)  # noqa: E731
    y = lambda v: height - 14 - v / top * (height - 24)  # noqa: E731
    lines = [f'<polyline fill="none" stroke="{palette[i % 3]}" stroke-width="1.2" '
             f'points="{" ".join(f"{x(j):.1f},{y(v):.1f}" for j, v in enumerate(s))}"/>'
             for i, s in enumerate(series.values())]
    text = 'font-size="9" fill="#666" font-family="sans-serif"'
    lines += [f'<text x="{left - 3}" y="12" text-anchor="end" {text}>{top:.3g}</text>',
              f'<text x="{left - 3}" y="{height - 14}" text-anchor="end" {text}>0</text>',
              f'<text x="{left}" y="{height - 2}" {text}>{html.escape(x_label)}: 1</text>',
              f'<text x="{width - 5}" y="{height - 2}" text-anchor="end" {text}>{n}</text>']
    if mark is not None:
        lines.append(f'<line x1="{x(mark):.1f}" x2="{x(mark):.1f}" y1="0" y2="{height - 14}" stroke="#999" '
                     f'stroke-dasharray="3"/>')
    legend = " ".join(f'<span style="color:{palette[i % 3]}">■ {html.escape(k)}</span>' for i, k in enumerate(series))
    return (f"<div style='font:12px sans-serif'>{html.escape(title)} ({html.escape(unit)}; max {top:.3g}) {legend}</div>"
            f'<svg width="{width}" height="{height}" style="background:#fafafa">{"".join(lines)}</svg>')


def margins_html(report) -> str:
    series = {f"side {side}": [getattr(r, side).margin for r in report.records if getattr(r, side) is not None]
              for side in "ab"}
    split = report.first_divergence.position if report.first_divergence else None
    return _svg_lines(series, mark=split, unit="logits", x_label="generated token",
                      title="top-1 minus top-2 logit per generated token (small = a near-tie; the dashed line is the split)")


def layers_html(report) -> str:
    note = getattr(report, "layer_note", None)
    note_html = f"<div style='font:12px sans-serif;color:#555'>{html.escape(note)}</div>" if note else ""
    if not report.layer_diffs:
        return note_html or "<i>no divergence: no layer table</i>"
    shown = [d for d in report.layer_diffs if getattr(d, "comparable", True)]
    series = {"over the whole prefix (what the KV cache holds)": [d.prefix_rel_l2 for d in shown],
              "at the split row": [d.at_split_rel_l2 for d in shown]}
    chart = _svg_lines(series, unit="relative L2 = ||b - a|| / ||a||, no unit", x_label="layer (embedding first)",
                       title="how far side b's residual stream is from side a's, per layer")
    rows = "".join(f"<tr><td>{html.escape(d.layer)}</td><td>{d.prefix_rel_l2:.2e}</td><td>{d.at_split_rel_l2:.2e}</td>"
                   f"<td>{'' if d.first_differing_position is None else d.first_differing_position}</td></tr>"
                   if getattr(d, "comparable", True) else
                   f"<tr><td>{html.escape(d.layer)}</td><td colspan=3>not comparable (see the note)</td></tr>"
                   for d in report.layer_diffs)
    left = getattr(report, "first_layer_difference", None)
    if left is not None:
        note_html += (f"<div class='minivllm-first-leave' style='font:12px sans-serif'><b>b first leaves a at "
                      f"{html.escape(left['layer'])}, sequence position {left['position']}</b> "
                      f"({'a prompt token' if left['in_prompt'] else 'a generated token'})</div>")
    return (note_html + chart + "<table style='font:11px monospace'><tr><th>after</th><th>whole prefix, rel L2</th>"
            "<th>split row, rel L2</th><th>first differing sequence position</th></tr>" + rows + "</table>")


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
        how = (f"<br><b>{html.escape(_tie_words(tok))}</b>" if _is_tie(tok) else f" (margin {tok.margin:.4f} logits)")
        cols.append(f"<td style='vertical-align:top'><b>{side}</b> chose {html.escape(repr(tok.text))}{how}"
                    f"<table style='font:11px monospace'><tr><th>text</th><th>id</th><th>logit</th></tr>{rows}</table></td>")
    return f"<div>top-k logits at generated token {position + 1}</div><table><tr>{''.join(cols)}</tr></table>"


def report_html(report, position: int | None = None) -> str:
    """Every view of one report as static HTML."""
    if position is None:
        position = report.first_divergence.position if report.first_divergence else 0
    return summary_html(report) + tokens_html(report) + margins_html(report) + topk_html(report, position) + layers_html(report)


class DivergenceExplorer:
    def __init__(self, llm=None, prompt: str = "Once upon a time, in a village at the edge of a great forest, there lived",
                 a: dict | None = None, b: dict | None = None, *, model: str = "smollm2-135m", max_tokens: int = 96,
                 chat: bool = False):
        """`llm`: run on this loaded LLM (the model box then shows it and is read-only);
        without one, the model box names what `compare` loads."""
        self.llm = llm
        self.report = None
        if llm is not None:
            info = llm.info()
            loaded = f"{Path(info['model_path']).name} ({info['device']}, {info['activation_dtype']})"
            self.model = W.Text(value=loaded, description="model", disabled=True,
                                tooltip="the LLM this explorer was given", layout=W.Layout(width="60%"))
        else:
            self.model = W.Text(value=model, description="model", placeholder="name or .gguf path")
        self.prompt = W.Textarea(value=prompt, layout=W.Layout(width="100%"))
        self.chat = W.Checkbox(value=chat, description="chat (wrap in the model's template)", indent=False)
        # Per side: the engine, its engine options (text, as `key=value, ...`), device and dtype.
        self.a_engine, self.a, self.a_device, self.a_dtype = self._side_form("a", DEFAULT_A if a is None else a)
        self.b_engine, self.b, self.b_device, self.b_dtype = self._side_form("b", DEFAULT_B if b is None else b)
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=2048, description="max tokens")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.status = W.HTML()
        self.summary = W.HTML()
        self.tokens, self.margins, self.layers, self.topk = W.HTML(), W.HTML(), W.HTML(), W.HTML()
        # 1-based, as the texts count tokens ("token 14"); the report's positions are 0-based
        self.position = W.IntSlider(value=1, min=1, max=1, description="token", continuous_update=False)
        self.run_button.on_click(lambda _: self.run())
        self.position.observe(lambda change: self._show_position(change["new"] - 1), names="value")
        sides = [W.HBox([getattr(self, f"{x}_engine"), getattr(self, x), getattr(self, f"{x}_device"),
                         getattr(self, f"{x}_dtype")]) for x in "ab"]
        self.widget = W.VBox([W.HBox([self.model, self.max_tokens]), self.prompt, self.chat, *sides,
                              W.HBox([self.run_button, self.status]), self.summary, self.tokens, self.margins,
                              self.position, self.topk, self.layers])

    @staticmethod
    def _side_form(side: str, spec):
        engine, options, device, dtype = split_side(spec)
        engines = engine_choices()
        if engine not in engines:
            engines.append(engine)  # shown as asked; Run says why it cannot run here
        engine_w = W.Dropdown(options=engines, value=engine, description=side, layout=W.Layout(width="220px"))
        text = W.Text(value=", ".join(f"{k}={json.dumps(v)}" for k, v in options.items()),
                      placeholder="engine options: key=value, ...", layout=W.Layout(width="40%"))
        devices = device_choices()
        if device not in [v for _, v in devices]:
            devices.append((device, device))
        device_w = W.Dropdown(options=devices, value=device, description="device", layout=W.Layout(width="200px"))
        dtype_w = W.Dropdown(options=DTYPE_CHOICES, value=dtype if dtype in dict(DTYPE_CHOICES).values() else SAME,
                             description="dtype", layout=W.Layout(width="200px"))

        def follow(_=None):  # options and dtype are minivllm's; llama.cpp runs on the CPU only
            text.disabled = dtype_w.disabled = engine_w.value != "minivllm"
            device_w.disabled = engine_w.value == "llama.cpp"

        engine_w.observe(follow, names="value")
        follow()
        return engine_w, text, device_w, dtype_w

    def side(self, side: str):
        """What `compare` gets for side "a" or "b" from the form."""
        return side_spec(getattr(self, f"{side}_engine").value, getattr(self, side).value,
                         getattr(self, f"{side}_device").value, getattr(self, f"{side}_dtype").value, side)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def run(self):
        from minivllm.debug import compare
        from minivllm.errors import MinivllmError

        self.status.value = "running…"
        try:
            a, b = self.side("a"), self.side("b")
            target = self.llm if self.llm is not None else self.model.value.strip()
            report = compare(target, self.prompt.value, a=a, b=b, max_tokens=self.max_tokens.value,
                             chat=self.chat.value)
        except (MinivllmError, ValueError) as exc:
            self.clear()  # the old report must not stand under the error as if it answered this run
            self.status.value = f"<span style='color:#c00'>{html.escape(str(exc))}</span>"
            return None
        self.status.value = "done"
        return self.show(report)

    def clear(self) -> None:
        self.report = None
        for view in (self.summary, self.tokens, self.margins, self.layers, self.topk):
            view.value = ""
        self.position.value, self.position.max = 1, 1

    def show(self, report):
        """Draw an existing report (from `compare`, or loaded) without running it again."""
        self.report = report
        if self.llm is None:  # the form says what this report ran
            self.model.value = report.model
            self.chat.value = bool(report.chat)
        self.summary.value = summary_html(report)
        self.tokens.value = tokens_html(report)
        self.margins.value = margins_html(report)
        self.layers.value = layers_html(report)
        split = report.first_divergence.position if report.first_divergence else 0
        self.position.max = max(1, len(report.records))
        self.position.value = split + 1
        self._show_position(split)
        return report

    def _show_position(self, position: int) -> None:
        if self.report is not None:
            self.topk.value = topk_html(self.report, position)
