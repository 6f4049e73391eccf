"""What each worker of a running `Cluster` holds over time: its queues and KV pages,
sampled every `interval_s` on a background thread (a notebook's timeline of one request,
issue 43's split drawn beside both workers' queues).

    with SnapshotSampler(cluster, interval_s=0.05) as sampler:
        ... submit, stream ...
    sampler.samples  # [{"t", "worker", "running", "waiting", "held_pages", "cached_pages", "total_pages"}]

Why one thread per worker, each asking its own worker for a fresh engine snapshot (the
`snapshot` round trip that `Cluster.snapshot(fresh=True)` makes for every worker in turn):
a worker answers between its steps, so one busy in a long prefill step would hold back the
samples of the idle one too. A sample's `t` is the wall clock (`time.time()`, the clock of
the split record's `started_at`) when the answer came back; a worker busy in one long step
shows as a gap between its samples, which is what it was doing.

`held_pages`: pages some request holds (used minus the prefix cache's idle pages);
`cached_pages`: pages only the prefix cache holds (kept for reuse, evictable).
"""

from __future__ import annotations

import threading
import time

QUERY_TIMEOUT_S = 10.0


def sample_row(worker: str, t: float, snap: dict) -> dict:
    """One worker's engine snapshot as a sample: queue lengths and page counts."""
    queues, kv, cache = snap["queues"], snap["kv"], snap["prefix_cache"]
    idle = cache.get("idle_pages", 0) if cache.get("enabled", True) else 0
    return {"t": t, "worker": worker, "running": len(queues["running"]),
            "waiting": len(queues["waiting"]) + len(queues["preempted"]),
            "held_pages": kv["used_pages"] - idle, "cached_pages": idle, "total_pages": kv["total_pages"]}


class SnapshotSampler:
    """Samples every worker of `cluster` (all of them, or `workers`) until `stop()`."""

    def __init__(self, cluster, interval_s: float = 0.05, workers: list[str] | None = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s}: give a positive sampling interval in seconds, e.g. 0.05")
        self.cluster, self.interval_s = cluster, interval_s
        self.workers = list(workers or cluster.workers)
        self.samples: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> "SnapshotSampler":
        for name in self.workers:
            t = threading.Thread(target=self._run, args=(name,), name=f"sampler-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> list[dict]:
        """Stop sampling; the samples in time order."""
        self._stop.set()
        for t in self._threads:
            t.join(QUERY_TIMEOUT_S + 1)
        self._threads = []
        with self._lock:
            self.samples.sort(key=lambda s: s["t"])
            return list(self.samples)

    def __enter__(self) -> "SnapshotSampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, name: str) -> None:
        handle = self.cluster.workers[name]
        next_tick = time.monotonic()
        while not self._stop.is_set():
            snap = handle.query("snapshot", QUERY_TIMEOUT_S)
            if snap is not None:
                row = sample_row(name, time.time(), snap)
                with self._lock:
                    self.samples.append(row)
            next_tick = max(next_tick + self.interval_s, time.monotonic())
            self._stop.wait(next_tick - time.monotonic())
