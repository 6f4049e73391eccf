"""Builds minivllm's wheel the way `make wheel` does, from a copy of the sources in a temporary
folder, for the tests that install it (tests/e2e/test_wheel.py, test_kaggle_fresh_venv.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO_ROOT


def build_wheel(tmp_path: Path) -> Path:
    # A copy of the sources, so the build never meets a stale build/ folder in the checkout
    # (nor writes one there while someone else builds).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, src)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO_ROOT / "minivllm", src / "minivllm", ignore=ignore)
    shutil.copytree(REPO_ROOT / "widgets", src / "widgets", ignore=ignore)
    dist = tmp_path / "dist"
    # The same command as `make wheel`.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = dist.glob("minivllm-*-py3-none-any.whl")
    return wheel
