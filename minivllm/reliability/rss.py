"""RSS of a server process and its workers, sampled on a thread while the soak runs."""

from __future__ import annotations

import math
import statistics
import threading
import time


class RssSampler:
    """RSS of the server process and each of its children, every `interval_s`, on a thread."""

    def __init__(self, server_pid: int | None, worker_pids: dict[int, str], interval_s: float = 1.0):
        self.server_pid, self.worker_pids, self.interval_s = server_pid, dict(worker_pids), interval_s
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-rss", daemon=True)
        self.error: str | None = None

    def label(self, proc) -> str:
        if proc.pid == self.server_pid:
            return "server"
        if proc.pid in self.worker_pids:
            return f"worker {self.worker_pids[proc.pid]}"
        try:
            name = proc.name()
        except Exception:  # noqa: BLE001
            name = "?"
        return f"child {name} ({proc.pid})"

    def sample(self) -> None:
        import psutil

        procs = []
        if self.server_pid is not None:
            try:
                root = psutil.Process(self.server_pid)
                procs = [root] + root.children(recursive=True)
            except psutil.Error:
                procs = []
        else:
            for pid in self.worker_pids:
                try:
                    procs.append(psutil.Process(pid))
                except psutil.Error:
                    pass
        row = {}
        for p in procs:
            try:
                row[self.label(p)] = p.memory_info().rss
            except psutil.Error:
                pass
        self.samples.append((time.perf_counter(), row))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - report, do not kill the soak
                self.error = repr(exc)
            self._stop.wait(self.interval_s)

    def start(self) -> "RssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, t0: float, t1: float) -> dict:
        """Per process: mean RSS of the first and of the last quarter of [t0, t1], delta, ratio, max."""
        quarter = (t1 - t0) / 4
        window = [(t, row) for t, row in self.samples if t0 <= t <= t1]
        names = sorted({n for _, row in window for n in row})
        out = {}
        for name in names:
            series = [(t, row[name]) for t, row in window if name in row]
            first = [v for t, v in series if t <= t0 + quarter]
            last = [v for t, v in series if t >= t1 - quarter]
            f = statistics.fmean(first) if first else math.nan
            la = statistics.fmean(last) if last else math.nan
            out[name] = {"samples": len(series), "first_quarter_mb": f / 2**20, "last_quarter_mb": la / 2**20,
                         "delta_mb": (la - f) / 2**20, "ratio": la / f if f and f == f else math.nan,
                         "max_mb": max(v for _, v in series) / 2**20}
        return out

    def series(self, t0: float, every_s: float = 10.0) -> dict[str, list]:
        """A coarse series for the result file: [[seconds since t0, MB], ...] per process."""
        out: dict[str, list] = {}
        last: dict[str, float] = {}
        for t, row in self.samples:
            for name, v in row.items():
                if name not in last or t - last[name] >= every_s:
                    out.setdefault(name, []).append([round(t - t0, 1), round(v / 2**20, 1)])
                    last[name] = t
        return out
