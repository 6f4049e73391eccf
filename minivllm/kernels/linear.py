"""Linear layers over weights dequantized once at load time.

This is the reference path: weights live in the activation dtype on the model's
device and every matmul goes to torch (cuBLAS on CUDA, the CPU BLAS otherwise).
The kernels issue replaces it with quantized GEMV/GEMM dispatch behind the same
`__call__`.
"""

from __future__ import annotations

import torch

from minivllm.obs.trace import trace_scope


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, name: str = "linear"):
        self.weight = weight  # (out_features, in_features), activation dtype
        self.bias = bias
        self.name = name  # the projection, shown in traces ("attn_q", "ffn_down", ...)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with trace_scope("qmatmul", self.name):
            y = x.to(self.weight.dtype) @ self.weight.T
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y
