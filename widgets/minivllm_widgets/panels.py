"""The live panels. Each has a widget, `view(snapshot)` (pure, cheap, comparable) and
`render(view)` (called by the publisher thread only, when the view changed)."""

from __future__ import annotations

import ipywidgets as W

from minivllm_widgets import html_views, panel_state
from minivllm_widgets.page_grid import render_page_grid


class Panel:
    title = ""

    css_class = ""

    def __init__(self):
        self.last_view = object()  # never equal to a real view: the first poll renders
        self.widget = self.build()
        if self.css_class:  # a stable hook for the browser test and for user styling
            self.widget.add_class(self.css_class)

    def build(self) -> W.Widget:
        return W.HTML()

    def view(self, snapshot: dict | None):
        raise NotImplementedError

    def render(self, view) -> None:
        raise NotImplementedError


class _HTMLPanel(Panel):
    empty = "<i>no cluster running</i>"

    def render(self, view) -> None:
        self.widget.value = self.empty if view is None else self.to_html(view)

    def to_html(self, view) -> str:
        raise NotImplementedError


class QueuesPanel(_HTMLPanel):
    title = "Queues"
    css_class = "minivllm-queues"

    def view(self, snapshot):
        return None if snapshot is None else panel_state.queues_view(snapshot)

    def to_html(self, view):
        return html_views.queues_html(view)


class RouterPanel(_HTMLPanel):
    title = "Router"
    css_class = "minivllm-router"

    def view(self, snapshot):
        return None if snapshot is None else panel_state.router_view(snapshot)

    def to_html(self, view):
        return html_views.router_html(view)


class SpeculativePanel(_HTMLPanel):
    title = "Speculative decoding"

    def view(self, snapshot):
        return None if snapshot is None else panel_state.speculative_view(snapshot)

    def to_html(self, view):
        return html_views.speculative_html(view)


class ThroughputPanel(_HTMLPanel):
    title = "Throughput and latency"

    def __init__(self):
        self.tracker = panel_state.ThroughputTracker()
        self._seen_time = None
        self._latest: dict = {}
        super().__init__()

    def _series(self, snapshot):
        if snapshot["time"] != self._seen_time:  # a repeated snapshot is not a new measurement
            self._seen_time = snapshot["time"]
            self._latest = self.tracker.update(snapshot)
        return self._latest

    def view(self, snapshot):
        return None if snapshot is None else (self._series(snapshot), {k: list(v) for k, v in self.tracker.step_ms.items()})

    def to_html(self, view):
        series, step_ms = view
        return html_views.throughput_svg(series) + html_views.latency_svg(step_ms)


class KVPanel(Panel):
    """One PNG page grid per worker (binary buffer), with a caption."""

    title = "KV pages"
    css_class = "minivllm-kv"

    def build(self):
        self._images: dict[str, W.Image] = {}
        self._captions: dict[str, W.HTML] = {}
        self._legend = W.HTML(html_views.kv_legend_html())
        return W.VBox([self._legend])

    def view(self, snapshot):
        return None if snapshot is None else panel_state.kv_view(snapshot)

    def render(self, view) -> None:
        view = view or {}
        if list(view) != list(self._images):  # the worker set changed: rebuild the layout once
            self._images = {name: W.Image(format="png") for name in view}
            self._captions = {name: W.HTML() for name in view}
            children = [self._legend]
            for name in view:
                children += [self._captions[name], self._images[name]]
            self.widget.children = children
        previous = self.last_view if isinstance(self.last_view, dict) else {}
        for name, w in view.items():
            if previous.get(name) == w:
                continue  # only the workers whose pages changed are sent
            self._captions[name].value = html_views.kv_caption_html(name, w)
            if w is not None:
                self._images[name].value = render_page_grid(w["states"], w["ref_counts"])


def default_panels() -> list[Panel]:
    return [QueuesPanel(), KVPanel(), RouterPanel(), SpeculativePanel(), ThroughputPanel()]
