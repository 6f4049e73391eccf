"""SnapshotSampler (serving/snapshot_sampler.py): a sample's counts from a hand-made engine
snapshot (held = used minus the prefix cache's idle pages; waiting includes preempted), and
the sampler against fake worker handles: every worker sampled on its own thread, a worker
that does not answer leaves no row, stop() ends every thread and returns rows in time order."""

from __future__ import annotations

import threading
import time

import pytest

from minivllm.serving.snapshot_sampler import SnapshotSampler, sample_row


def _snap(running=1, waiting=2, preempted=1, used=80, idle=75, total=768, cache=True):
    return {"queues": {"running": [{}] * running, "waiting": [{}] * waiting, "preempted": [{}] * preempted},
            "kv": {"used_pages": used, "total_pages": total},
            "prefix_cache": {"enabled": cache, "idle_pages": idle if cache else 0}}


def test_sample_row_counts():
    row = sample_row("cpu", 12.5, _snap())
    assert row == {"t": 12.5, "worker": "cpu", "running": 1, "waiting": 3, "held_pages": 5, "cached_pages": 75,
                   "total_pages": 768}
    assert sample_row("cpu", 0.0, _snap(cache=False, used=40))["held_pages"] == 40


class _Handle:
    def __init__(self, snap, block: threading.Event | None = None):
        self.snap, self.block, self.calls = snap, block, 0

    def query(self, op, timeout):
        assert op == "snapshot"
        self.calls += 1
        if self.block is not None:  # a worker inside one long step: no answer until released
            self.block.wait(timeout)
            return None
        return self.snap


def test_sampler_threads_per_worker():
    stuck = threading.Event()
    workers = {"a": _Handle(_snap(running=1)), "b": _Handle(_snap(running=0, used=0, idle=0)),
               "c": _Handle(None, stuck)}
    cluster = type("C", (), {"workers": workers})()
    sampler = SnapshotSampler(cluster, interval_s=0.01).start()
    time.sleep(0.2)
    stuck.set()  # the stuck worker answers nothing; it must not have held the others back
    rows = sampler.stop()
    by = {w: [r for r in rows if r["worker"] == w] for w in workers}
    assert len(by["a"]) >= 5 and len(by["b"]) >= 5 and by["c"] == []
    assert {r["running"] for r in by["a"]} == {1} and {r["held_pages"] for r in by["b"]} == {0}
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
    assert not any(t.name.startswith("sampler-") for t in threading.enumerate())


def test_bad_interval():
    with pytest.raises(ValueError, match="interval_s"):
        SnapshotSampler(type("C", (), {"workers": {}})(), interval_s=0)
