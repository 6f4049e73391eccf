"""The bound on automatic restarts, with a real worker that can no longer start.

One one-thread CPU worker (SmolLM2-135M) loads a copy of the model file; the copy is
then deleted and the worker killed, so every replacement fails to load. With
`max_worker_restarts=2` the cluster tries exactly twice (after 0.5 s, then 1 s), gives up,
and says so in `/health`; nothing is left running or unreaped; a restart by hand, once the
file is back, brings the worker back and clears the count. And a calibrated worker that
restarts by itself takes its predecessor's rates (no calibration stage while it loads).

References: the process table (psutil: this process's children running
`minivllm.serving.worker`, zombies included), the supervisor's threads, and the worker's
own error from its failed loads (the missing file), the loading stages each worker
reports, and the rates the killed worker last reported.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import psutil
import pytest

from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving import Cluster
from minivllm.serving.calibration_turns import TURN_STAGE
from minivllm.serving.router import NoWorkerAvailable

DEADLINE_S = 120.0  # liveness only

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class WorkerPids:
    """Every worker process this test's cluster starts, seen by polling this process's
    children (`minivllm.serving.worker` in the command line) while the test runs. Only
    those pids are checked afterwards: a full session's other children (servers of other
    modules) may exit and sit unreaped meanwhile, and are not this cluster's."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self._before = {pid for pid, _ in self._workers()}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @staticmethod
    def _workers() -> set[tuple[int, str]]:
        found = set()
        for child in psutil.Process().children(recursive=True):
            try:
                if "minivllm.serving.worker" in " ".join(child.cmdline()):
                    found.add((child.pid, child.status()))
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
        return found

    def _poll(self) -> None:
        while not self._done.wait(0.01):
            self.seen |= {pid for pid, _ in self._workers()} - self._before

    def left(self) -> set[tuple[int, str]]:
        """(pid, status) of this cluster's workers still in the process table, zombies included."""
        out = set()
        for pid in self.seen:
            try:
                out.add((pid, psutil.Process(pid).status()))
            except psutil.NoSuchProcess:
                pass
        return out

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def wait_for(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def healer_running() -> bool:
    return any(t.name.startswith("minivllm-heal-") for t in threading.enumerate())


def test_a_worker_that_cannot_start_is_not_restarted_forever(smollm2_path, tmp_path):
    model = tmp_path / "model.gguf"
    shutil.copy(smollm2_path, model)
    pids = WorkerPids()
    with Cluster(str(model), ["cpu:1"], calibrate=False, max_model_len=256, max_worker_restarts=2) as cluster:
        stream = cluster.submit("Count to ten:", SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        wait_for(lambda: stream.token_ids, "a first token")
        model.unlink()  # every new worker fails to load from now on
        pid = cluster.workers["cpu"].transport.pid
        os.kill(pid, signal.SIGKILL)
        out = stream.result(30)
        assert out.finish_reason == "error" and "worker cpu exited (killed by SIGKILL)" in stream.error, stream.error
        assert "restarting it automatically in 0.5 s" in stream.error, stream.error

        wait_for(lambda: cluster.health()["workers"][0]["restarts"]["state"] == "gave_up", "the supervisor to give up")
        wait_for(lambda: not healer_running(), "the healer thread to end")
        health = cluster.health()
        worker = health["workers"][0]
        assert health["status"] == "down" and worker["state"] == "failed", health
        r = worker["restarts"]
        assert (r["automatic"], r["failed"], r["manual"], r["in_window"]) == (2, 2, 0, 2), r
        assert "max_worker_restarts=2" in r["gave_up"] and str(model) in r["gave_up"], r["gave_up"]
        assert "killed by SIGKILL" in r["last_cause"]
        # Nothing left behind: no worker process, not even a zombie, and no more attempts.
        assert len(pids.seen) >= 3, pids.seen  # the first worker and the two failed attempts were seen
        # The watcher reaps a failed worker just after it marks it failed: under load that can
        # trail the health report by a moment, so wait for it (a zombie never reaped fails).
        wait_for(lambda: not pids.left(), "every worker of this cluster reaped")
        assert cluster.health()["workers"][0]["restarts"]["automatic"] == 2
        with pytest.raises(NoWorkerAvailable):
            cluster.submit("Hello", SamplingParams(max_tokens=2))

        # Fixed by hand: the route (or restart_worker) brings it back and the count starts over.
        shutil.copy(smollm2_path, model)
        cluster.restart_worker("cpu")
        health = cluster.health()
        r = health["workers"][0]["restarts"]
        assert health["status"] == "ok" and (r["state"], r["manual"], r["in_window"]) == ("up", 1, 0), health
        again = cluster.submit("Name a colour:", SamplingParams(temperature=0.0, max_tokens=3))
        assert again.result(60).finish_reason in ("stop", "length") and again.error is None
    pids.stop()
    assert pids.left() == set()


def test_workers_calibrate_in_turns_and_a_restarted_one_takes_its_predecessors_rates(smollm2_path):
    events: list[tuple[str, str, str]] = []
    stages: list[tuple[str, str]] = []  # the first worker's

    def on_progress(name, state, stage):
        events.append((name, stage))
        if name == "cpu":
            stages.append((state, stage))

    with Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], max_model_len=256, on_progress=on_progress) as cluster:
        # both warmed up before either calibrated, then one calibration at a time, in order
        first_calibration = min(events.index((n, "calibration")) for n in ("cpu", "cpu#2"))
        assert all(events.index((n, TURN_STAGE)) < first_calibration for n in ("cpu", "cpu#2")), events
        assert events.index(("cpu", "ready")) < events.index(("cpu#2", "calibration")), events
        assert ("starting", "calibration") in stages
        before = cluster.workers["cpu"]
        assert before.rates.known and before.rates_wire["source"] == "calibration"
        measured = [before.rates.prefill_rate()] + [before.rates.decode_rate(b) for b in (1, 4)]
        stages.clear()
        os.kill(before.transport.pid, signal.SIGKILL)
        wait_for(lambda: cluster.workers["cpu"] is not before and cluster.health()["status"] == "ok",
                 "the worker to restart by itself")
        after = cluster.workers["cpu"]
        assert ("starting", "calibration") not in stages and ("ready", "ready") in stages, stages
        assert ("starting", TURN_STAGE) not in stages  # a restart waits for no turn: the others serve
        assert after.rates_wire["source"] == "predecessor"
        assert [after.rates.prefill_rate()] + [after.rates.decode_rate(b) for b in (1, 4)] == pytest.approx(measured)
