"""A real Ray cluster of several nodes on this machine, for the Ray backend's tests.

Each node is `ray start ... --block` in a session of its own (a head, then nodes joined
with `ray start --address`), each with the CPUs of one worker. Killing a node's process
group with SIGKILL is what a host crash does to its raylet; the workers Ray started there
(own sessions) notice their raylet is gone and exit. Every process carries a tag in its
environment, so teardown finds and kills what is left, and nothing of another Ray on
this machine is touched. Token authentication is off for this loopback-only cluster
(RAY_AUTH_MODE=disabled for its nodes, their workers and this process): left to itself,
`ray start` adopts whatever ~/.ray/auth_token an earlier private instance wrote, and a
driver that imported Ray before that file existed is refused.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from minivllm.serving.http_server import free_port

TAG = "MINIVLLM_TEST_RAY_TAG"
NODE_TAG = "MINIVLLM_TEST_RAY_NODE"  # which of the cluster's nodes a process belongs to


def ray_cli() -> str:
    found = Path(sys.executable).with_name("ray")
    return str(found) if found.exists() else (shutil.which("ray") or "ray")


class RayNodes:
    def __init__(self, cpus_per_node: int = 1):
        self.cpus = cpus_per_node
        self.tag = uuid.uuid4().hex[:12]
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen] = []
        self.node_ids: list[str] = []
        self.auth = {"RAY_AUTH_MODE": "disabled"}
        self._saved_env = {k: os.environ.get(k) for k in self.auth}

    def _start(self, args: list[str], env: dict | None) -> subprocess.Popen:
        full_env = {**os.environ, TAG: self.tag, NODE_TAG: str(len(self.nodes)), "RAY_USAGE_STATS_ENABLED": "0",
                    **self.auth, **(env or {})}
        proc = subprocess.Popen([ray_cli(), "start", *args, f"--num-cpus={self.cpus}", "--num-gpus=0", "--block",
                                 "--disable-usage-stats"], env=full_env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.nodes.append(proc)
        return proc

    def start_head(self) -> "RayNodes":
        os.environ.update(self.auth)  # this process joins the same way
        self._start(["--head", "--node-ip-address=127.0.0.1", f"--port={self.port}", "--include-dashboard=false"], None)
        self._wait_nodes(1)
        return self

    def add_node(self, env: dict | None = None) -> str:
        """Join one more node; returns its node id."""
        before = set(self.alive())
        self._start([f"--address={self.address}", "--node-ip-address=127.0.0.1"], env)
        new = self._wait_nodes(len(before) + 1) - before
        (node_id,) = new
        self.node_ids.append(node_id)
        return node_id

    def alive(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n["Alive"]}

    def _wait_nodes(self, count: int, timeout: float = 120.0) -> set[str]:
        import ray

        deadline = time.monotonic() + timeout
        while True:
            try:
                if not ray.is_initialized():
                    ray.init(address=self.address, namespace="minivllm", logging_level="WARNING")
                alive = self.alive()
                if len(alive) >= count:
                    if len(self.node_ids) == 0 and count == 1:
                        self.node_ids = list(alive)
                    return alive
            except ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray cluster at {self.address} did not reach {count} nodes in {timeout:g} s")
            time.sleep(0.5)

    def kill_node(self, index: int) -> int:
        """SIGKILL everything of node `index` at once, as a host crash would: its raylet's
        session and the workers it started (sessions of their own, found by the node tag
        they inherit). Left to notice their raylet's death, the workers took seconds on a
        loaded machine, long enough to finish the streams a test meant to cut. Returns how
        many processes outside the raylet's session it killed."""
        os.killpg(self.nodes[index].pid, signal.SIGKILL)
        killed = 0
        for proc in self.tagged_processes():
            try:
                if proc.environ().get(NODE_TAG) == str(index):
                    proc.kill()
                    killed += 1
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        self.nodes[index].wait(10)
        return killed

    def tagged_processes(self) -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get(TAG) == self.tag:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for proc in reversed(self.nodes):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # `ray start --block` stops its node on SIGTERM
                except ProcessLookupError:
                    pass
        for proc in self.nodes:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        deadline = time.monotonic() + 10
        while (left := self.tagged_processes()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
