"""`Workbench()`: launch workers, watch the engine live, send requests, in one widget.

    from minivllm_widgets import Workbench
    wb = Workbench(model="smollm2-135m")     # a form; Launch starts a Cluster
    wb                                       # displays it and starts the publisher
    wb.open_beside()                         # the dashboard in JupyterLab's side panel (sidecar)
    wb.static_html()                         # the same views as plain HTML (nbconvert, Kaggle)

Every live view is fed by one publisher thread (publisher.py) from `Cluster.snapshot()`,
minivllm's public contract; nothing here reaches into the engine.
"""

from __future__ import annotations

import html
import time

import ipywidgets as W

from minivllm_widgets import html_views, panel_state, static_charts
from minivllm_widgets.composer import Composer, composer_html
from minivllm_widgets.launcher import ClusterRunner, Launcher
from minivllm_widgets.panels import Panel, default_panels
from minivllm_widgets.publisher import Publisher


class _StatusPanel(Panel):
    def __init__(self, runner: ClusterRunner, target: W.HTML):
        self.runner, self.target = runner, target
        super().__init__()

    def build(self):
        return self.target

    def view(self, snapshot):
        return self.runner.status_view()

    def render(self, view) -> None:
        phase, error, progress = view
        lines = [f"<b>{html.escape(phase)}</b>"]
        if error:
            lines.append(f"<span style='color:#c00'>{html.escape(error)}</span>")
        lines += [f"{html.escape(w)}: {html.escape(p)}" for w, p in progress]
        self.widget.value = "<br>".join(lines)


class _LivePanel(Panel):
    """The dashboard's first line: live, or stopped (the views below keep the last state)."""

    def __init__(self, runner: ClusterRunner, workbench: "Workbench"):
        self.runner, self.workbench = runner, workbench
        super().__init__()

    def view(self, snapshot):
        watching = self.workbench.watching
        return (self.runner.phase, watching, self.runner.stopped_at, len(snapshot["workers"]) if snapshot else 0)

    def render(self, view) -> None:
        phase, watching, stopped_at, workers = view
        if phase == "stopped":
            when = time.strftime("%H:%M:%S", time.localtime(stopped_at)) if stopped_at else ""
            text = (f"<b style='color:#c00'>■ cluster stopped</b> at {when}: the views below show its final state")
        elif phase == "running" and not watching:
            text = "<b style='color:#c60'>■ not watching</b>: the cluster runs on; the views below are not updated"
        elif phase == "running":
            text = f"<b style='color:#188038'>● live</b>: {workers} worker(s), redrawn when their snapshots change"
        else:
            text = f"<i>{html.escape(phase)}: no cluster running</i>"
        self.widget.value = f"<div class='minivllm-live' data-phase='{phase}'>{text}</div>"


class _ComposerPanel(Panel):
    def __init__(self, composer: Composer):
        self.composer = composer
        super().__init__()

    def view(self, snapshot):
        return self.composer.view()

    def render(self, view) -> None:
        self.widget.value = composer_html(view)


class Workbench:
    def __init__(self, model: str = "smollm2-135m", devices: list[str] | None = None, *, cluster=None,
                 max_hz: float = 10.0, page_map: str = "auto", **defaults):
        """`cluster`: show an already started Cluster instead of launching one. `page_map`:
        "browser" (the KV map painted from state bytes; needs anywidget), "png", or "auto"."""
        self.runner = ClusterRunner()
        self.watching = False
        if cluster is not None:
            self.runner.cluster, self.runner.phase = cluster, "running"
        self.launcher = Launcher(model, devices, **defaults)
        self.launcher.launch.on_click(lambda _: self.runner.launch(self.launcher.options()))
        self.launcher.stop.on_click(lambda _: self.runner.stop())
        self.composer = Composer(self.runner)
        self.panels = default_panels(page_map)
        composer_panel = _ComposerPanel(self.composer)
        self.live = live = _LivePanel(self.runner, self)
        extra = [_StatusPanel(self.runner, self.launcher.status), composer_panel, live]
        self.publisher = Publisher(self.runner.snapshot, self.panels + extra, max_hz=max_hz)
        self.dashboard = self._compact_dashboard()
        self.widget = W.Tab(children=[self.launcher.widget, self.dashboard,
                                      W.VBox([self.composer.widget, composer_panel.widget])])
        for i, title in enumerate(["Launch", "Dashboard", "Requests"]):
            self.widget.set_title(i, title)
        if cluster is not None:
            self.widget.selected_index = 1  # already running: open on the dashboard

    def _compact_dashboard(self) -> W.VBox:
        """The headline figures, then one row of small multiples (the KV map beside the
        throughput and latency charts), then the tables, folded: about one screen tall."""
        by_class = {type(p).__name__: p for p in self.panels}
        kv, throughput = by_class["KVPanel"], by_class["ThroughputPanel"]
        # Fixed sizes, wrapping as the screen allows (one row on a wide screen or projector):
        # a plotly figure first drawn inside a hidden tab would otherwise take a default
        # width wider than its box, and its newest points would be cut off at the right.
        for fig in throughput.figures:
            fig.layout.height, fig.layout.width = 210, 430
        throughput.widget.layout = W.Layout(flex_flow="row wrap")
        row = W.HBox([kv.widget, throughput.widget], layout=W.Layout(flex_flow="row wrap", align_items="flex-start"))
        details = [p for p in self.panels if p not in (kv, throughput, by_class["HeadlinePanel"])]
        tables = W.Accordion(children=[p.widget for p in details])
        for i, p in enumerate(details):
            tables.set_title(i, p.title)
        tables.selected_index = 0  # the queues open
        self.beside = W.Button(
            description="open beside the notebook",
            icon="columns",
            tooltip="the dashboard in JupyterLab's side panel, in view while you run the cells below",
            layout=W.Layout(width="auto"),
        )
        self.beside.on_click(lambda _: self.open_beside())
        box = W.VBox([W.HBox([self.live.widget, self.beside]), by_class["HeadlinePanel"].widget, row, tables])
        box.add_class("minivllm-dashboard")
        return box

    def open_beside(self, title: str = "minivllm dashboard"):
        """The dashboard in JupyterLab's right-hand panel (jupyter-widgets' `sidecar`), so it
        stays in view while you scroll and run the cells that drive it."""
        from IPython.display import display

        try:
            from sidecar import Sidecar
        except ImportError:
            raise ImportError(
                "open_beside() needs sidecar (in minivllm's notebook extra): pip install sidecar"
            ) from None
        self._sidecar = Sidecar(title=title, anchor="split-right")
        with self._sidecar:
            display(self.dashboard)
        self.watching = True
        self.publisher.start()
        return self._sidecar

    @property
    def cluster(self):
        return self.runner.cluster

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
        self.watching = True
        self.publisher.start()

    def static_html(self) -> str:
        """The dashboard as self-contained HTML (the page maps and the charts as plotly
        figures, plotly.js inline), for places where widgets cannot render: nbconvert, a
        Kaggle "Save & Run All" commit."""
        # fresh: every worker is asked now, so requests that just returned are not shown running
        snapshot = self.runner.snapshot(fresh=True)
        if snapshot is None:
            return "<i>no cluster running</i>"
        tracker = next((p.tracker for p in self.panels if hasattr(p, "tracker")), None)
        throughput = tracker.series if tracker is not None else {}
        step_ms = tracker.step_ms if tracker is not None else {}
        head = ("<div><b>cluster stopped</b>: its final state</div>" if self.runner.phase == "stopped" else
                f"<div>cluster state at {time.strftime('%H:%M:%S', time.localtime(snapshot['time']))}</div>")
        return "".join([
            static_charts.plotlyjs_html(), head,
            "<h4>Queues</h4>", html_views.queues_html(panel_state.queues_view(snapshot)),
            "<h4>KV pages</h4>", html_views.kv_static_html(panel_state.kv_view(snapshot), plotlyjs=False),
            "<h4>Router</h4>", html_views.router_html(panel_state.router_view(snapshot)),
            "<h4>Speculative decoding</h4>", html_views.speculative_html(panel_state.speculative_view(snapshot)),
            "<h4>Throughput and latency</h4>", html_views.throughput_static_html(throughput, step_ms)])

    def show_static(self) -> None:
        from IPython.display import HTML, display

        display(HTML(self.static_html()))

    def close(self, stop_cluster: bool = True) -> None:
        """Stop the publisher and (by default) the cluster. The views then show the
        cluster's final state (a fresh snapshot taken as it stops) under a "stopped" mark."""
        self.publisher.stop()
        self.watching = False
        if stop_cluster:
            self.runner.stop(wait=True)
        try:
            self.publisher.poll_once()  # the final frame, from this thread: the publisher's has ended
        except Exception as exc:  # noqa: BLE001 - closing must not fail over a view
            self.publisher.last_error = f"{type(exc).__name__}: {exc}"
