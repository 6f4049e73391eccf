"""The one thread that touches widgets.

Jupyter drops widget messages beyond about 1000 per second, and a widget changed from
several threads can interleave half-updates. So: one publisher thread polls the cluster
snapshot at most `max_hz` times a second (default 10, never above 20), asks every panel
for its view model, and renders only the panels whose view changed, each inside one
`hold_sync()` (one message per widget; a plotly figure is redrawn in one `batch_update()`,
which plotly's protocol sends as four small messages). Producers elsewhere (token streams, launch
progress) only write plain Python state that a panel reads on the next poll: nothing is
ever sent per token or per page.
"""

from __future__ import annotations

import threading
import time
import traceback

MAX_HZ = 20.0


class Publisher:
    def __init__(self, source, panels: list, *, max_hz: float = 10.0):
        """`source()` returns the latest cluster snapshot or None (no cluster running)."""
        if not 0 < max_hz <= MAX_HZ:
            raise ValueError(
                f"max_hz must be in (0, {MAX_HZ}]: the Jupyter server drops widget messages beyond ~1000/s"
            )
        self.source = source
        self.panels = list(panels)
        self.period = 1.0 / max_hz
        self.renders = 0  # panel renders so far (each one message per widget it changes)
        self.polls = 0
        self.last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> int:
        """One poll: render the panels whose view changed; returns how many did."""
        snapshot = self.source()
        self.polls += 1
        rendered = 0
        for panel in self.panels:
            view = panel.view(snapshot)
            if view == panel.last_view:
                continue
            panel.render(view)
            panel.last_view = view
            rendered += 1
        self.renders += rendered
        return rendered

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a dashboard glitch must not kill the dashboard
                self.last_error = traceback.format_exc(limit=3)
            self._stop.wait(max(0.0, self.period - (time.monotonic() - started)))

    def start(self) -> "Publisher":
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="minivllm-widgets-publisher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
