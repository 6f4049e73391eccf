"""The restart policy of self-healing workers (serving/worker_recovery.py), without processes.

References: the backoff written out by hand (0.5 s doubling to a 30 s cap, at most
`limit` in a 600 s window, the window sliding on a clock this test sets), and a fake
restart function that records each call and fails or succeeds as told.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from minivllm.errors import ConfigError
from minivllm.serving.worker_recovery import WorkerRecovery, WorkerSupervisor, check_max_worker_restarts


def test_backoff_doubles_to_its_cap_and_the_bound_slides_with_the_window():
    rec = WorkerRecovery(limit=8)
    delays = []
    for k in range(8):
        delays.append(rec.next_delay(100.0 + k))
        rec.recent.append(100.0 + k)
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert rec.next_delay(110.0) is None  # 8 restarts in the last 600 s: the bound
    assert rec.next_delay(100.0 + 600.5) == 30.0  # the oldest left the window: one more allowed
    assert rec.next_delay(110.0 + 600.0) == 0.5  # all of them left it: the backoff starts over


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", None])
def test_max_worker_restarts_must_be_a_count(bad):
    with pytest.raises(ConfigError, match="max_worker_restarts"):
        check_max_worker_restarts(bad)


class FakeCluster:
    """A worker that fails to come back `fails` times, then comes back."""

    def __init__(self, fails: int):
        self.fails, self.calls, self.ready = fails, [], False
        self.done = threading.Event()

    def restart(self, name: str) -> Future:
        self.calls.append((name, time.monotonic()))
        f = Future()
        if len(self.calls) <= self.fails:
            f.set_exception(RuntimeError(f"worker {name} did not restart: the model file is gone"))
        else:
            self.ready = True
            f.set_result(None)
            self.done.set()
        return f


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_failing_restart_is_retried_after_a_longer_delay_until_it_comes_up():
    fake = FakeCluster(fails=1)
    sup = WorkerSupervisor(fake.restart, lambda name: fake.ready, max_restarts=3)
    down_at = time.monotonic()
    note = sup.worker_down("cpu#2", "worker cpu#2 exited (killed by SIGKILL)")
    assert note == "restarting it automatically in 0.5 s"
    assert sup.describe("cpu#2")["state"] == "waiting"
    assert fake.done.wait(30)
    wait_for(lambda: sup.describe("cpu#2")["state"] == "up")
    (_, first), (_, second) = fake.calls
    assert first - down_at >= 0.5 and second - first >= 1.0  # 0.5 s, then 1 s after the failure
    r = sup.describe("cpu#2")
    assert (r["automatic"], r["failed"], r["manual"], r["in_window"]) == (2, 1, 0, 2)
    assert r["last_cause"] == "worker cpu#2 exited (killed by SIGKILL)" and r["gave_up"] is None


def test_a_worker_that_never_comes_back_is_given_up_and_a_restart_by_hand_resets_it():
    fake = FakeCluster(fails=10**6)
    sup = WorkerSupervisor(fake.restart, lambda name: fake.ready, max_restarts=2)
    sup.worker_down("cpu", "worker cpu exited (exit code 1)")
    wait_for(lambda: sup.describe("cpu")["state"] == "gave_up")
    assert len(fake.calls) == 2
    r = sup.describe("cpu")
    assert (r["automatic"], r["failed"]) == (2, 2)
    assert "max_worker_restarts=2" in r["gave_up"] and "the model file is gone" in r["gave_up"]
    # Dying again while given up schedules nothing, and says so.
    note = sup.worker_down("cpu", "worker cpu exited (exit code 1)")
    assert note.startswith("gave up restarting it automatically after 2 restarts")
    assert not [t for t in threading.enumerate() if t.name == "minivllm-heal-cpu"]
    assert len(fake.calls) == 2
    sup.restarted_by_hand("cpu")
    r = sup.describe("cpu")
    assert (r["state"], r["manual"], r["in_window"]) == ("up", 1, 0)


def test_zero_turns_automatic_restarts_off_and_stop_ends_a_waiting_healer():
    fake = FakeCluster(fails=0)
    off = WorkerSupervisor(fake.restart, lambda name: False, max_restarts=0)
    assert "automatic restarts are off" in off.worker_down("cpu", "gone")
    assert off.describe("cpu")["state"] == "off" and not fake.calls

    sup = WorkerSupervisor(fake.restart, lambda name: False, max_restarts=3)
    sup.worker_down("cpu", "gone")
    sup.stop()
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "minivllm-heal-cpu"])
    assert not fake.calls
    assert sup.worker_down("cpu", "gone again") == "the cluster is stopping"


def test_serve_declares_the_bound_once():
    from minivllm.cli.main import build_parser
    from minivllm.cli.serve_cmd import cluster_kwargs
    from minivllm.serving.worker_recovery import DEFAULT_MAX_WORKER_RESTARTS

    parser = build_parser()
    assert parser.parse_args(["serve"]).max_worker_restarts == DEFAULT_MAX_WORKER_RESTARTS == 5
    assert cluster_kwargs(parser.parse_args(["serve", "--max-worker-restarts", "0"]))["max_worker_restarts"] == 0
