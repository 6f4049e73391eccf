"""The live panels. Each has a widget, `view(snapshot)` (pure, cheap, comparable) and
`render(view)` (called by the publisher thread only, when the view changed)."""

from __future__ import annotations

import ipywidgets as W

from minivllm_widgets import chart_data, charts, html_views, panel_state
from minivllm_widgets.page_map_widget import make_page_map


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


class ThroughputPanel(Panel):
    """Decode tok/s and step latency per worker: two plotly figures over one shared time
    window, updated in place (one message per figure) when a new measurement arrives."""

    title = "Throughput and latency"
    css_class = "minivllm-throughput"

    def __init__(self, window_s: float = chart_data.DASHBOARD_WINDOW_S):
        self.tracker = panel_state.ThroughputTracker()
        self.window_s = window_s
        self._seen_time = None
        self._latest: dict = {}
        super().__init__()

    def build(self):
        self.figures = (charts.figure_widget(), charts.figure_widget())
        return W.HBox(list(self.figures))

    def _series(self, snapshot):
        if snapshot["time"] != self._seen_time:  # a repeated snapshot is not a new measurement
            self._seen_time = snapshot["time"]
            self._latest = self.tracker.update(snapshot)
        return self._latest

    def view(self, snapshot):
        if snapshot is None:
            return None
        throughput = self._series(snapshot)  # first: it records this snapshot's step latency too
        step_ms = {k: list(v) for k, v in self.tracker.step_ms.items()}
        return chart_data.dashboard_charts(throughput, step_ms, window_s=self.window_s)

    def render(self, view) -> None:
        empty = chart_data.dashboard_charts({}, {}, window_s=self.window_s)
        for fig, chart in zip(self.figures, view or empty):
            charts.update_figure(fig, chart)


class HeadlinePanel(_HTMLPanel):
    """The headline figures per worker, above the small multiples."""

    title = "At a glance"
    css_class = "minivllm-headline"

    def __init__(self, throughput: "ThroughputPanel"):
        self.throughput = throughput  # its tracker's newest rate: the number its chart ends on
        super().__init__()

    def view(self, snapshot):
        return None if snapshot is None else panel_state.headline_view(snapshot, self.throughput.tracker.series)

    def to_html(self, view):
        return html_views.headline_html(view)


class KVPanel(Panel):
    """One page map per worker (state bytes painted in the browser, or a PNG without
    anywidget), with a caption that counts each state."""

    title = "KV pages"
    css_class = "minivllm-kv"

    def __init__(self, page_map: str = "auto"):
        self.page_map = page_map
        make_page_map(page_map)  # an unknown kind fails here, at construction
        super().__init__()

    def build(self):
        self._maps: dict[str, W.Widget] = {}
        # crisp cells in the PNG fallback too (JupyterLab would smooth a scaled image)
        self._legend = W.HTML(
            "<style>.minivllm-kv img{image-rendering:pixelated}</style>" + html_views.kv_legend_html()
        )
        return W.VBox([self._legend])

    def view(self, snapshot):
        return None if snapshot is None else panel_state.kv_view(snapshot)

    def render(self, view) -> None:
        view = view or {}
        if list(view) != list(self._maps):  # the worker set changed: rebuild the layout once
            self._maps = {name: make_page_map(self.page_map) for name in view}
            self.widget.children = [self._legend] + list(self._maps.values())
        previous = self.last_view if isinstance(self.last_view, dict) else {}
        for name, w in view.items():
            if name in previous and previous[name] == w:
                continue  # only the workers whose pages changed are sent
            # no snapshot (starting, restarting): an empty map, never the old picture
            self._maps[name].show(b"" if w is None else w["codes"], html_views.kv_caption_html(name, w),
                                  owners={} if w is None else w.get("owners", {}))


def default_panels(page_map: str = "auto") -> list[Panel]:
    """Every live panel; the throughput panel comes before the headline that reads its
    tracker, so the headline's rate is this poll's."""
    throughput = ThroughputPanel()
    return [QueuesPanel(), KVPanel(page_map), RouterPanel(), SpeculativePanel(), throughput, HeadlinePanel(throughput)]
