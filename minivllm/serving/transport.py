"""The controller <-> worker link, kept behind one small interface.

The controller only ever calls `send`, `recv`, `alive`, `kill`, `describe_exit` and
`close` on a `WorkerTransport`; the worker only `send` and `recv` on its endpoint.
Messages are plain JSON-serialisable dicts (see protocol.py), so a transport only has to
move them. `ProcessTransport` is the local one: a child Python process and a socket pair
carrying length-prefixed UTF-8 JSON. `ray_transport.RayTransport` puts the same worker in
a Ray actor on any node of a Ray cluster.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from multiprocessing.connection import Connection


class TransportClosed(Exception):
    """The other side is gone (process exited, pipe closed)."""


class WorkerTransport(ABC):
    """Controller side of one worker."""

    @abstractmethod
    def send(self, msg: dict) -> None: ...

    @abstractmethod
    def recv(self, timeout: float | None) -> dict | None:
        """The next message, or None after `timeout` seconds; raises TransportClosed."""

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def exit_code(self) -> int | None: ...

    @abstractmethod
    def kill(self) -> None: ...

    @abstractmethod
    def describe_exit(self) -> str:
        """How the worker ended, in words, for the error its requests get."""

    @property
    def location(self) -> dict:
        """Where the worker runs (host, node), for snapshots; empty while unknown."""
        return {}

    @abstractmethod
    def close(self, timeout: float = 10.0) -> None:
        """Wait for a worker that was asked to shut down, then release everything."""

    @property
    @abstractmethod
    def pid(self) -> int | None: ...


class Endpoint:
    """One end of a pipe speaking JSON; `send` may be called from several threads."""

    def __init__(self, conn):
        self._conn = conn
        self._send_lock = threading.Lock()

    def send(self, msg: dict) -> None:
        data = json.dumps(msg, separators=(",", ":")).encode()
        with self._send_lock:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError) as exc:  # ValueError: the pipe was closed here
                raise TransportClosed(str(exc)) from exc

    def recv(self, timeout: float | None) -> dict | None:
        try:
            if timeout is not None and not self._conn.poll(timeout):
                return None
            return json.loads(self._conn.recv_bytes())
        except (EOFError, OSError, ValueError) as exc:
            raise TransportClosed(str(exc) or type(exc).__name__) from exc

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


class ProcessTransport(WorkerTransport):
    """A worker in a local child process: `python -m <module> <fd>`, where fd is one end
    of a socket pair and the first message on it is the worker's config.

    A fresh interpreter rather than multiprocessing's spawn, because spawn re-imports the
    parent's __main__ script: a user script without an `if __name__ == "__main__"` guard
    would start workers recursively. Neither CUDA nor a notebook kernel survives fork.
    The worker's stdout and stderr are the parent's, so its warnings stay visible.
    """

    def __init__(self, module: str, config: dict, *, name: str):
        ours, theirs = socket.socketpair()
        self._endpoint = Endpoint(Connection(ours.detach()))
        env = {**os.environ, "MINIVLLM_WORKER_NAME": name}
        self._process = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()  # only the worker holds it now, so its death closes the link
        self._endpoint.send(config)

    def send(self, msg: dict) -> None:
        self._endpoint.send(msg)

    def recv(self, timeout: float | None) -> dict | None:
        return self._endpoint.recv(timeout)

    def alive(self) -> bool:
        return self._process.poll() is None

    def exit_code(self) -> int | None:
        return self._process.poll()

    def kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()

    def describe_exit(self) -> str:
        """The exit code or signal. The pipe closes a moment before the OS reports the exit,
        so wait briefly for the code instead of printing None."""
        deadline = time.monotonic() + 2.0
        code = self._process.poll()
        while code is None and time.monotonic() < deadline:
            time.sleep(0.02)
            code = self._process.poll()
        if code is None:
            return "exit status not known yet"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    @property
    def location(self) -> dict:
        return {"host": socket.gethostname(), "pid": self._process.pid}

    def close(self, timeout: float = 10.0) -> None:
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._endpoint.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid
