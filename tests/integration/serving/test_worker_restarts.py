"""Concurrent restarts through the HTTP API never leak worker processes.

Two real one-thread CPU workers (SmolLM2-135M) behind the real HTTP server; the router
is forced to `cpu#2`, so streams run there while `cpu` is restarted five times at once.
The first restart is held in progress (its new worker's progress callback waits on an
event) until the cluster has counted the other four as joined, so the check does not
depend on how fast the machine is. References: the operating system's process table
(psutil: the children of this test process running `minivllm.serving.worker`), the
pids the cluster reports, and the streams' own SSE endings.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import psutil
import pytest

from minivllm.serving import Cluster
from minivllm.serving.http_server import start_server_in_background

KEY = "restart-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DEADLINE_S = 180.0  # liveness only

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def worker_processes() -> set[int]:
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if "minivllm.serving.worker" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_for(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def test_five_concurrent_restarts_leave_one_process_per_worker(smollm2_path):
    baseline = worker_processes()  # workers of other tests' clusters in this session, if any
    release, armed = threading.Event(), threading.Event()
    held: list[str] = []

    def on_progress(name, state, stage):
        # The replacement `cpu` worker reports its loading stages here; hold the first
        # restart in progress until the other four calls have joined it.
        if armed.is_set() and name == "cpu" and state == "starting" and not held:
            held.append(stage)
            release.wait(DEADLINE_S)

    cluster = Cluster(str(smollm2_path), ["cpu:1", "cpu:1"], router="forced:cpu#2", max_model_len=256,
                      calibrate=False, on_progress=on_progress).start()
    srv = start_server_in_background(cluster, api_key=KEY)
    armed.set()
    try:
        old_pid = cluster.workers["cpu"].transport.pid
        survivor_pid = cluster.workers["cpu#2"].transport.pid
        assert worker_processes() - baseline == {old_pid, survivor_pid}

        async def stream(client, i):
            body = {"prompt": f"Count slowly to {i + 20}:", "max_tokens": 48, "ignore_eos": True, "stream": True,
                    "temperature": 0}
            async with client.stream("POST", srv.url + "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200, await r.aread()
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]

        async def restart(client):
            r = await client.post(srv.url + "/v1/cluster/workers/cpu/restart", headers=AUTH)
            return r.status_code, r.json()

        async def drill():
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                streams = [asyncio.create_task(stream(client, i)) for i in range(3)]
                restarts = [asyncio.create_task(restart(client)) for _ in range(5)]
                await asyncio.to_thread(wait_for, lambda: cluster.restart_counters["joined"] == 4 and held,
                                        "four restarts to join the first")
                release.set()
                return await asyncio.gather(*streams), await asyncio.gather(*restarts)

        stream_lines, restarts = asyncio.run(drill())
        assert cluster.restart_counters == {"started": 1, "joined": 4, "failed": 0}
        new_pid = cluster.workers["cpu"].transport.pid
        assert new_pid != old_pid
        for status, health in restarts:
            assert status == 200 and health["status"] == "ok", health
            assert {w["name"]: w["pid"] for w in health["workers"]} == {"cpu": new_pid, "cpu#2": survivor_pid}
        # Exactly one process per worker; the replaced one is gone (reaped, not a zombie).
        assert worker_processes() - baseline == {new_pid, survivor_pid}
        assert not psutil.pid_exists(old_pid)
        for lines in stream_lines:
            assert lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2][len("data: "):])
            assert last["choices"][0]["finish_reason"] == "length" and last["minivllm"]["worker"] == "cpu#2"
        # A restart after the first one ended is a new restart (serialised, not swallowed),
        # and a caller that stops waiting cannot cancel it for the others.
        pending = cluster.restart_worker_async("cpu")
        assert not pending.cancel()
        pending.result(DEADLINE_S)
        assert cluster.restart_counters == {"started": 2, "joined": 4, "failed": 0}
        assert worker_processes() - baseline == {cluster.workers["cpu"].transport.pid, survivor_pid}
    finally:
        release.set()
        srv.stop()
        cluster.stop()
    assert worker_processes() - baseline == set()  # stop() reaped every process it started
