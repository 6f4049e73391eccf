"""Self-healing workers: a worker that dies, or is killed as hung, is restarted by itself.

`WorkerHandle` tells the supervisor the moment it marks its worker dead (before the
requests it held fail, so their error can say what happens next). The supervisor then
restarts the worker on a thread of its own, through the cluster's serialised restart
(`Cluster.restart_worker_async`, the one the HTTP restart route uses, so an automatic and
a manual restart of one worker never run side by side), after a backoff:

    delay before the n-th automatic restart in the window = min(0.5 s * 2**(n-1), 30 s)

and within a bound: at most `max_worker_restarts` automatic restarts per worker in any
`RESTART_WINDOW_S` (10 minutes). A restart that does not come up (the model file is gone,
the GPU is broken) counts and is retried after the next delay; once the bound is reached
the supervisor gives up on that worker: it stays down, `/health` and the snapshot say why
(`restarts.state == "gave_up"`), and a restart by hand (the route, `Cluster.restart_worker`)
brings it back and clears the count. Restarts are counted per worker (automatic, failed,
by hand) in the cluster snapshot and as the Prometheus counter `minivllm_worker_restarts`.

While a worker is down or restarting the router skips it (it is not "ready"); the
replacement is routed to as soon as it is ready. The backend does not matter: the
supervisor only asks the cluster for a new handle, which builds a local process or a Ray
actor through the same `WorkerTransport` interface.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from minivllm.errors import ConfigError

# Enough to ride out a crash or two in a row (an OOM kill, a CUDA error), few enough that a
# worker that can never start stops costing a process start every few seconds.
DEFAULT_MAX_WORKER_RESTARTS = 5
RESTART_WINDOW_S = 600.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


def check_max_worker_restarts(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError("max_worker_restarts", value, "must be an integer >= 0 (automatic restarts of one worker "
                          f"in {RESTART_WINDOW_S:g} s; 0 turns them off)")
    return value


@dataclass
class WorkerRecovery:
    """One worker's restart record (by worker name: it outlives the handles it replaces)."""

    limit: int
    window_s: float = RESTART_WINDOW_S
    automatic: int = 0  # automatic restarts started, ever
    failed: int = 0  # automatic restarts that did not come up
    manual: int = 0  # restarts by hand (the route, Cluster.restart_worker)
    state: str = "up"  # up | waiting (backoff) | restarting | gave_up | off (limit 0)
    last_cause: str | None = None  # why the worker last went down
    last_error: str | None = None  # why the last automatic restart failed
    next_attempt_at: float | None = None  # time.monotonic() of the next attempt while waiting
    recent: deque = field(default_factory=deque)  # monotonic start times of automatic restarts in the window

    def next_delay(self, now: float) -> float | None:
        """The backoff before the next automatic restart, or None when the bound is reached."""
        while self.recent and now - self.recent[0] > self.window_s:
            self.recent.popleft()
        if len(self.recent) >= self.limit:
            return None
        return min(BACKOFF_FIRST_S * 2 ** len(self.recent), BACKOFF_MAX_S)

    def gave_up_reason(self) -> str:
        return (f"gave up restarting it automatically after {len(self.recent)} restarts in {self.window_s:g} s "
                f"(max_worker_restarts={self.limit}, serve --max-worker-restarts)"
                + (f"; the last one failed: {self.last_error}" if self.last_error else "")
                + "; restart it by hand (POST /v1/cluster/workers/<name>/restart) once the cause is fixed")

    def as_dict(self) -> dict:
        wait = None if self.next_attempt_at is None else max(0.0, self.next_attempt_at - time.monotonic())
        return {"state": self.state, "automatic": self.automatic, "failed": self.failed, "manual": self.manual,
                "in_window": len(self.recent), "max_in_window": self.limit, "window_s": self.window_s,
                "next_attempt_in_s": wait, "last_cause": self.last_cause, "last_error": self.last_error,
                "gave_up": self.gave_up_reason() if self.state == "gave_up" else None}


class WorkerSupervisor:
    def __init__(self, restart: Callable[[str], Future], is_ready: Callable[[str], bool], max_restarts: int):
        """`restart(name)`: start (or join) the serialised restart of that worker; `is_ready(name)`:
        whether its current handle serves (a restart by hand may have brought it back)."""
        self.max_restarts = check_max_worker_restarts(max_restarts)
        self._restart = restart
        self._is_ready = is_ready
        self._records: dict[str, WorkerRecovery] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def record(self, name: str) -> WorkerRecovery:
        with self._lock:
            return self._records.setdefault(name, WorkerRecovery(self.max_restarts,
                                                                 state="up" if self.max_restarts else "off"))

    def describe(self, name: str) -> dict:
        rec = self.record(name)
        with self._lock:
            return rec.as_dict()

    def worker_down(self, name: str, cause: str) -> str:
        """The handle of `name` has just marked its worker dead for `cause`. Schedules the
        restart (unless the bound says no) and returns what the failed requests' error adds."""
        rec = self.record(name)
        with self._lock:
            rec.last_cause = cause
            if self._stopped.is_set():
                return "the cluster is stopping"
            if not self.max_restarts:
                return "automatic restarts are off (max_worker_restarts=0); restart it by hand"
            if rec.state in ("waiting", "restarting"):
                # A healer is on it; it looks at the worker again before it ends (_heal).
                return "restarting it automatically"
            delay = rec.next_delay(time.monotonic())
            if delay is None:
                rec.state = "gave_up"
                return rec.gave_up_reason()
            rec.state = "waiting"
            rec.next_attempt_at = time.monotonic() + delay
        threading.Thread(target=self._heal, args=(name,), daemon=True, name=f"minivllm-heal-{name}").start()
        return f"restarting it automatically in {delay:g} s"

    def _heal(self, name: str) -> None:
        rec = self.record(name)
        while True:
            with self._lock:
                now = time.monotonic()
                delay = rec.next_delay(now)
                if delay is None:
                    rec.state, rec.next_attempt_at = "gave_up", None
                    return
                # The first attempt keeps the delay worker_down announced.
                start_at = rec.next_attempt_at if rec.next_attempt_at is not None else now + delay
                rec.state, rec.next_attempt_at = "waiting", start_at
            if self._stopped.wait(max(0.0, start_at - time.monotonic())):
                return
            if self._is_ready(name):  # restarted by hand meanwhile
                with self._lock:
                    rec.state, rec.next_attempt_at = "up", None
                return
            with self._lock:
                rec.recent.append(time.monotonic())
                rec.automatic += 1
                rec.state, rec.next_attempt_at = "restarting", None
            try:
                self._restart(name).result()
            except Exception as exc:  # noqa: BLE001 - counted, then retried after the next delay
                with self._lock:
                    rec.failed += 1
                    rec.last_error = " ".join(str(exc).split())[:500]
                if self._stopped.is_set():
                    return
                continue
            with self._lock:
                # The replacement may have died already; its worker_down saw this healer
                # at work and left the restart to it (the handle is marked dead first).
                if self._is_ready(name):
                    rec.state, rec.last_error = "up", None
                    return

    def restarted_by_hand(self, name: str) -> None:
        """A restart by hand came up: the worker is back, and its automatic count starts over."""
        rec = self.record(name)
        with self._lock:
            rec.manual += 1
            rec.recent.clear()
            if rec.state == "gave_up":  # a healer still waiting finds the worker ready and ends
                rec.state = "up"
            rec.last_error = None

    def stop(self) -> None:
        """No new restarts; a healer waiting out its backoff ends."""
        self._stopped.set()

    def resume(self) -> None:
        self._stopped.clear()


__all__ = ["DEFAULT_MAX_WORKER_RESTARTS", "RESTART_WINDOW_S", "WorkerRecovery", "WorkerSupervisor",
           "check_max_worker_restarts"]
