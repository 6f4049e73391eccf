"""`python -m minivllm serve ...` as a subprocess, started, health-checked and stopped cleanly.

Shared by the load generator (serve_load.py), its llama.cpp peer (llama_cpp_server.py) and the
soak (minivllm/reliability/), which all drive a real server over HTTP.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def serve_supports(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--help"], capture_output=True, text=True,
                         timeout=300)
    return flag in out.stdout


class ServerProcess:
    """`python -m minivllm serve ...` as a subprocess; its output goes to a log file."""

    def __init__(self, args: list[str], port: int, log_path: Path):
        self.args, self.port, self.log_path = args, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.worker_pids: dict[int, str] = {}
        self.orphans: list[str] = []  # children still alive after the server exited (then killed)

    def start(self, timeout_s: float, api_key: str | None = None) -> "ServerProcess":
        import httpx

        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env())
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} during start-up:\n{self.log_tail()}"
                )
            try:
                if self.is_ready(httpx):
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} was not healthy within {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.5)

    # A peer server (minivllm/bench/llama_cpp_server.py) overrides these and `name`.
    name = "minivllm serve"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "minivllm", "serve", *self.args]

    def env(self) -> dict | None:
        return None  # inherit ours

    def is_ready(self, httpx) -> bool:
        r = httpx.get(self.url + "/health", timeout=5)
        if r.status_code == 200 and r.json().get("status") == "ok":
            self.worker_pids = {w["pid"]: w["name"] for w in r.json()["workers"] if w.get("pid")}
            return True
        return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Ctrl-C (uvicorn shuts down, the cluster stops its workers), then SIGTERM, then SIGKILL;
        any worker of ours still alive afterwards is killed by pid."""
        if self.proc is None:
            return None
        children = []
        try:
            import psutil

            children = psutil.Process(self.proc.pid).children(recursive=True)
        except Exception:  # noqa: BLE001 - psutil missing or the process already gone
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        for child in children:
            try:
                child.wait(10)
            except Exception:  # noqa: BLE001 - still alive 10 s after its parent left: ours to kill
                self.orphans.append(f"{child.pid}")
                try:
                    child.kill()
                except Exception:  # noqa: BLE001
                    pass
        if self._log is not None:
            self._log.close()
        return self.proc.returncode
