"""Running the HTTP API: blocking (the CLI) or on a background thread (a notebook).

    server = start_server_in_background(cluster)      # 127.0.0.1, a free port
    server.url                                         # "http://127.0.0.1:PORT"
    server.stop()

The background server runs uvicorn with its own event loop on its own thread, so it
does not touch the notebook kernel's loop. Loopback is the default bind: serving on
other interfaces is an explicit choice (`--host 0.0.0.0`), ideally with `--api-key`.
Without a key, only loopback Host names, the bind address and `allowed_hosts` are
answered, and cross-site browser requests are refused (`http_origin.py`).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from minivllm.serving.http_api import create_app
from minivllm.serving.http_connections import guarded_protocol
from minivllm.serving.http_guards import ServerLimits
from minivllm.serving.http_origin import allowed_hosts_for

DEFAULT_HOST = "127.0.0.1"


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def serve(cluster, *, host: str = DEFAULT_HOST, port: int = 8000, api_key: str | None = None,
          limits: ServerLimits | None = None, log_level: str = "info", allowed_hosts: tuple[str, ...] = ()) -> None:
    """Serve until interrupted (Ctrl-C); the caller owns the cluster."""
    app = create_app(cluster, api_key=api_key, limits=limits, allowed_hosts=allowed_hosts_for(host, allowed_hosts))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                http=connection_guards(limits))


def connection_guards(limits: ServerLimits | None) -> type:
    """uvicorn's h11 protocol with the header-read timeout and the connection cap (which
    evicts idle connections first)."""
    limits = limits or ServerLimits()
    return guarded_protocol(limits.header_timeout_s, limits.max_connections)


class BackgroundServer:
    def __init__(self, cluster, *, host: str = DEFAULT_HOST, port: int = 0, api_key: str | None = None,
                 limits: ServerLimits | None = None, log_level: str = "warning", allowed_hosts: tuple[str, ...] = ()):
        self.host = host
        self.port = port or free_port(host)
        self.app = create_app(cluster, api_key=api_key, limits=limits,
                              allowed_hosts=allowed_hosts_for(host, allowed_hosts))
        self.protocol = connection_guards(limits)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level=log_level, timeout_graceful_shutdown=5,
                                http=self.protocol)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="minivllm-http", daemon=True)

    @property
    def connection_stats(self) -> dict[str, int]:
        """Connections closed by the guards: {"header_timeouts": n, "refused": n}."""
        return dict(self.protocol.stats)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        if self._thread.ident is None:
            self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.url} exited during start-up (is the port in use?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP server on {self.url} did not start within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server_in_background(cluster, *, host: str = DEFAULT_HOST, port: int = 0, api_key: str | None = None,
                               limits: ServerLimits | None = None, log_level: str = "warning",
                               allowed_hosts: tuple[str, ...] = ()) -> BackgroundServer:
    return BackgroundServer(cluster, host=host, port=port, api_key=api_key, limits=limits, log_level=log_level,
                            allowed_hosts=allowed_hosts).start()
