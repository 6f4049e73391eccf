"""Every request the cluster accepted, and how each one ended: the ledger that proves
nothing is lost.

A request counts as open from the moment it is routed until its stream receives its one
terminal event (stop, length, abort or error). A second terminal event for a stream that
already ended is counted as a duplicate instead of being delivered, so the soak test and
the fault drills can assert `open == 0` and `duplicate_terminals == 0` after any mix of
cancels, disconnects and dead workers.
"""

from __future__ import annotations

import threading
from collections import Counter


class RequestAccounting:
    def __init__(self):
        self._lock = threading.Lock()
        self.submitted = 0
        self.ended: Counter[str] = Counter()
        self.duplicate_terminals = 0
        self._open: set[str] = set()

    def opened(self, request_id: str) -> None:
        with self._lock:
            self.submitted += 1
            self._open.add(request_id)

    def closed(self, request_id: str, finish_reason: str | None) -> None:
        with self._lock:
            if request_id in self._open:
                self._open.remove(request_id)
                self.ended[finish_reason or "unknown"] += 1
            else:
                self.duplicate_terminals += 1

    def duplicate(self, request_id: str) -> None:
        with self._lock:
            self.duplicate_terminals += 1

    def as_dict(self) -> dict:
        with self._lock:
            return {"submitted": self.submitted, "open": len(self._open), "open_ids": sorted(self._open)[:20],
                    "ended": dict(self.ended), "duplicate_terminals": self.duplicate_terminals}
