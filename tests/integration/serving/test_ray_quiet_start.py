"""The Ray backend's private instance starts without Ray's "token authentication" warning
on stderr (it showed as a pink line under the serving notebook's Ray cell).

Reference: Ray's own text. A new local `ray.init()` with RAY_AUTH_MODE unset logs "Token
authentication is enabled for this Ray cluster" (or "... is disabled ..." in older
releases); the test starts the backend's connect in a fresh interpreter with RAY_AUTH_MODE
removed from its environment and reads that interpreter's stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

pytest.importorskip("ray")

START = """
import os
from minivllm.serving.ray_transport import connect
assert connect(None)  # the Ray backend's start (Cluster(backend="ray", ray_address=None))
print("auth mode", os.environ.get("RAY_AUTH_MODE"), flush=True)
import ray
ray.shutdown()
"""


def test_private_ray_instance_starts_without_the_token_authentication_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "auth mode token" in done.stdout  # the mode Ray picks for a new local instance, chosen explicitly
    assert "token authentication" not in done.stderr.lower(), done.stderr[-3000:]
