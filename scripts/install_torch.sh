#!/usr/bin/env bash
# Install torch into the venv without ever pulling the multi-GB CUDA build onto a
# CPU-only machine. Idempotent: an importable torch is left alone.
#   - NVIDIA GPU present (nvidia-smi works): the default PyPI build (CUDA).
#   - CPU only: torch==2.13.0 when a local wheel of it exists (pip's find-links),
#     otherwise the CPU wheel index of PyTorch.
set -euo pipefail
PY=${1:?usage: install_torch.sh VENV_PYTHON}
if "$PY" -c "import torch" 2>/dev/null; then
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  exec "$PY" -m pip install "torch>=2.4"
fi
if "$PY" -m pip download --no-deps --no-index -d /tmp/minivllm-torch-probe torch==2.13.0 >/dev/null 2>&1; then
  exec "$PY" -m pip install torch==2.13.0
fi
exec "$PY" -m pip install torch --index-url https://download.pytorch.org/whl/cpu
