"""The prompt's GEMM on the CPU in float32: oneDNN instead of the default BLAS.

torch sends a float32 `x @ w.T` to MKL, which on AMD processors runs its AVX2 kernels:
78 GFLOP/s on one core of this project's AMD EPYC (AVX-512) for a 512 x 896 x 4864
product, against 198-211 GFLOP/s for oneDNN's float32 matmul on the same core (torch
already sends bf16 matmuls there: 379-426 GFLOP/s). Both accumulate in float32; only
the summation order differs, as between any two BLAS builds (max |error| vs float64
1.2e-4 and 5.5e-5 on outputs of magnitude ~100). So float32 prefill takes oneDNN's
float32 matmul, reached through the op torch's own inductor uses for linear layers
(`torch.ops.mkldnn._linear_pointwise`, in torch since 2.0). Where that op is missing or
fails its first-use check against `x @ w.T`, or MINIVLLM_CPU_GEMM=blas, the default BLAS
runs, with the same result up to rounding.
"""

from __future__ import annotations

import os

import torch

_STATE: dict = {}


def onednn_available() -> bool:
    """Whether float32 GEMMs here take oneDNN (checked once per process)."""
    if "ok" not in _STATE:
        _STATE["ok"] = _check()
    return _STATE["ok"]


def _check() -> bool:
    if os.environ.get("MINIVLLM_CPU_GEMM", "") == "blas" or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(7, 64, generator=g), torch.randn(24, 64, generator=g)
        y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return y.dtype == torch.float32 and torch.allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


def matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for CPU tensors: oneDNN for float32 where available, else torch's default."""
    if x.dtype == torch.float32 and w.dtype == torch.float32 and x.dim() == 2 and onednn_available():
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return x @ w.T
