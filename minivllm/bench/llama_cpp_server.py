"""llama-cpp-python's OpenAI-compatible server as a peer for `minivllm bench serve`.

`python -m llama_cpp.server` (the package's `[server]` extra) serves the same GGUF file
that minivllm serves, so the load generator can send both the same seeded requests in one
run. It is started with the same CPU thread count for prompt and generation, a context
of `n_ctx` tokens, and every layer on the CPU unless `gpu_layers` says otherwise. It
serves requests one at a time (one llama context behind a lock), which is what a user of
that server gets; the comparison shows what continuous batching is worth under load.

Readiness is GET /v1/models answering 200: that server has no /health route.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from minivllm.bench.server_process import ServerProcess
from minivllm.errors import ConfigError

LABEL = "llama-cpp-python"


def check_installed(llama_cpp_path: str | None = None) -> None:
    """Raise a ConfigError naming the fix when llama-cpp-python's server cannot start here."""
    if llama_cpp_path:
        sys.path.insert(0, llama_cpp_path)
    try:
        missing = [m for m in ("llama_cpp", "sse_starlette", "starlette_context", "pydantic_settings")
                   if importlib.util.find_spec(m) is None]
    finally:
        if llama_cpp_path:
            sys.path.remove(llama_cpp_path)
    if missing:
        raise ConfigError("start_peer", LABEL, f"needs {', '.join(missing)}: `make peers` builds llama-cpp-python "
                          "from its sdist with its [server] extra (or pip install 'llama-cpp-python[server]')")


class LlamaCppServer(ServerProcess):
    name = "llama_cpp.server"

    def __init__(self, model_path: str | Path, port: int, log_path: Path, *, threads: int, n_ctx: int,
                 gpu_layers: int = 0, llama_cpp_path: str | None = None):
        args = ["--model", str(model_path), "--host", "127.0.0.1", "--port", str(port),
                "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx),
                "--n_gpu_layers", str(gpu_layers),
                # Its default lets a new request interrupt the one streaming (the old stream
                # just ends); queueing is what a server under load should do, and what we measure.
                "--interrupt_requests", "False"]
        super().__init__(args, port, log_path)
        self.llama_cpp_path = llama_cpp_path

    def command(self) -> list[str]:
        return [sys.executable, "-m", "llama_cpp.server", *self.args]

    def env(self) -> dict | None:
        if not self.llama_cpp_path:
            return None
        # A site-packages outside this environment: only the child needs it on its path.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.llama_cpp_path, env.get("PYTHONPATH")) if p)
        return env

    def is_ready(self, httpx) -> bool:
        return httpx.get(self.url + "/v1/models", timeout=5).status_code == 200
