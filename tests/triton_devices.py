"""Where the Triton kernel tests run: compiled on a GPU, through Triton's interpreter on
CPU tensors otherwise.

Import this before anything imports a kernel module: `TRITON_INTERPRET` is read when a
kernel is defined, so it must be set first. The test modules import it at the top.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1; this GPU machine tests the compiled kernel")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
