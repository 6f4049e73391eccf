"""The divergence explorer: why two "identical" greedy runs part, on `minivllm.debug.compare`.

Pick a prompt and two sides (default: GEMM for every row vs the row-wise GEMV path),
press Run, and see both texts aligned token by token with the first split highlighted,
the top-1 margin per position for both sides, the top-k logits at any position (slider),
and how far apart each layer's residual stream already was at the split. Each side is
an engine (minivllm; transformers, the float32 reference; llama.cpp where it imports),
and for minivllm its engine options, device and activation dtype (blank: the model's).

Compare runs inside the button's callback, on the kernel's thread, so every widget
update happens there too; it blocks the kernel for the seconds it takes. Before it starts,
the old report is dimmed and the form locked; a bar follows compare's phases (`on_phase`:
loading each side, generating each, the per-layer capture); fields a side ignores show
afterwards what it ran (a transformers side: f32).
`report_html(report)` renders the same views statically (nbconvert, Kaggle commits).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import ipywidgets as W

from minivllm_widgets import charts
from minivllm_widgets.chart_data import layer_chart, margin_chart
from minivllm_widgets.divergence_story import starting_position
from minivllm_widgets.divergence_views import (
    layer_note_html,
    layer_table_html,
    no_layers_words,
    report_html,
    summary_html,
    tokens_html,
    topk_html,
)

__all__ = ["DivergenceExplorer", "engine_choices", "parse_options", "report_html", "side_spec", "split_side"]

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


STALE_CSS = "<style>.minivllm-stale{opacity:0.3;pointer-events:none;transition:opacity .1s}</style>"


def ran_dtype_value(settings: dict) -> str | None:
    """The dtype menu's value for what a side ran in (transformers: f32), None when the
    menu has no such entry (llama.cpp's ggml)."""
    dtype = str(settings.get("dtype", ""))
    return dtype if dtype in dict(DTYPE_CHOICES).values() else None


class DivergenceExplorer:
    def __init__(
        self,
        llm=None,
        prompt: str = "Once upon a time, in a village at the edge of a great forest, there lived",
        a: dict | None = None,
        b: dict | None = None,
        *,
        model: str = "smollm2-135m",
        max_tokens: int = 96,
        chat: bool = False,
    ):
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
        self.a_engine, self.a, self.a_device, self.a_dtype, self._a_follow = self._side_form(
            "a", DEFAULT_A if a is None else a
        )
        self.b_engine, self.b, self.b_device, self.b_dtype, self._b_follow = self._side_form(
            "b", DEFAULT_B if b is None else b
        )
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=2048, description="max tokens")
        self.run_button = W.Button(description="Run", button_style="primary")
        self.status = W.HTML()
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, description="", bar_style="info",
                                        layout=W.Layout(width="240px", visibility="hidden"))
        self.summary = W.HTML()
        self.tokens, self.topk = W.HTML(), W.HTML()
        self.layer_note, self.layer_table = W.HTML(), W.HTML()
        self.margin_figure = charts.figure_widget(css_class="minivllm-margin-chart")
        self.layer_figure = charts.figure_widget(css_class="minivllm-layer-chart")
        # numbered from 1, as every text numbers generated tokens (minivllm.debug.token_number)
        self.position = W.IntSlider(value=1, min=1, max=1, description="token", continuous_update=False)
        self.run_button.on_click(lambda _: self.run())
        self.position.observe(lambda change: self._show_position(change["new"] - 1), names="value")
        sides = [W.HBox([getattr(self, f"{x}_engine"), getattr(self, x), getattr(self, f"{x}_device"),
                         getattr(self, f"{x}_dtype")]) for x in "ab"]
        self.form = [self.model, self.max_tokens, self.prompt, self.chat, self.run_button] + [
            w for x in "ab" for w in (getattr(self, f"{x}_engine"), getattr(self, x), getattr(self, f"{x}_device"),
                                      getattr(self, f"{x}_dtype"))]
        self.layer_box = W.VBox([])
        self.results = W.VBox([self.summary, self.tokens, self.margin_figure, self.position, self.topk, self.layer_note,
                               self.layer_box, self.layer_table])
        self.results.add_class("minivllm-divergence-results")
        self.widget = W.VBox([W.HTML(STALE_CSS), W.HBox([self.model, self.max_tokens]), self.prompt, self.chat, *sides,
                              W.HBox([self.run_button, self.progress, self.status]), self.results])

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
            if engine_w.value != "minivllm":
                dtype_w.value = SAME  # a greyed menu never claims a dtype the engine will not run in

        engine_w.observe(follow, names="value")
        follow()
        return engine_w, text, device_w, dtype_w, follow

    def side(self, side: str):
        """What `compare` gets for side "a" or "b" from the form."""
        return side_spec(getattr(self, f"{side}_engine").value, getattr(self, side).value,
                         getattr(self, f"{side}_device").value, getattr(self, f"{side}_dtype").value, side)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _busy(self, busy: bool) -> None:
        """While a run computes: the old report dimmed, the form locked, the bar shown."""
        if busy:
            self.results.add_class("minivllm-stale")
        else:
            self.results.remove_class("minivllm-stale")
        for w in self.form:
            w.disabled = busy
        if not busy:  # the fields a side ignores go back to greyed
            self._a_follow()
            self._b_follow()
            if self.llm is not None:
                self.model.disabled = True
        self.progress.layout.visibility = "visible" if busy else "hidden"

    def _phase(self, words: str, fraction: float) -> None:
        self.progress.value = fraction
        self.status.value = f"{html.escape(words)}…"

    def run(self):
        from minivllm.debug import compare
        from minivllm.errors import MinivllmError

        self._busy(True)  # first, before anything slow: the old report must not pass for this run's
        self._phase("starting", 0.0)
        try:
            a, b = self.side("a"), self.side("b")
            target = self.llm if self.llm is not None else self.model.value.strip()
            report = compare(target, self.prompt.value, a=a, b=b, max_tokens=self.max_tokens.value,
                             chat=self.chat.value, on_phase=self._phase)
        except (MinivllmError, ValueError) as exc:
            self.clear()  # the old report must not stand under the error as if it answered this run
            self._busy(False)
            self.status.value = f"<span style='color:#c00'>{html.escape(str(exc))}</span>"
            return None
        except BaseException:
            self._busy(False)
            self.status.value = "<span style='color:#c00'>failed (see the traceback)</span>"
            raise
        self._busy(False)
        self.progress.value = 1.0
        self.status.value = "done"
        return self.show(report)

    def clear(self) -> None:
        self.report = None
        for view in (self.summary, self.tokens, self.layer_note, self.layer_table, self.topk):
            view.value = ""
        self.margin_figure.data = []
        self.layer_box.children = []
        self.position.value, self.position.max = 1, 1

    def _show_ran(self, report) -> None:
        """Greyed fields say what each side actually ran (transformers: f32, whatever the menu said)."""
        for side in "ab":
            settings = getattr(report, f"{side}_settings", {}) or {}
            dtype_w = getattr(self, f"{side}_dtype")
            if dtype_w.disabled and ran_dtype_value(settings) is not None:
                dtype_w.value = ran_dtype_value(settings)

    def show(self, report):
        """Draw an existing report (from `compare`, or loaded) without running it again."""
        self.report = report
        if self.llm is None:  # the form says what this report ran
            self.model.value = report.model
            self.chat.value = bool(report.chat)
        self._show_ran(report)
        self.summary.value = summary_html(report)
        self.tokens.value = tokens_html(report)
        charts.update_figure(self.margin_figure, margin_chart(report))
        layers = layer_chart(report)
        self.layer_note.value = layer_note_html(report) or (
            "" if layers else f"<i>{html.escape(no_layers_words(report))}</i>"
        )
        if layers is not None:
            charts.update_figure(self.layer_figure, layers)
        self.layer_box.children = [self.layer_figure] if layers is not None else []  # no empty axes
        self.layer_table.value = layer_table_html(report) if report.layer_diffs else ""
        start = starting_position(report)
        self.position.max = max(1, len(report.records))
        self.position.value = start + 1
        self._show_position(start)
        return report

    def _show_position(self, position: int) -> None:
        if self.report is not None:
            self.topk.value = topk_html(self.report, position)
