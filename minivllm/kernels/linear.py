"""Linear layers over GGUF-block weights, with GEMV/GEMM dispatch by row count.

A projection keeps its weight as a `QuantizedWeight` (file bytes on the device) and
picks a path per call from `KernelOptions`:

    rows <= gemv_max_rows   "gemv"  fused dequantize-GEMV: Triton on CUDA (blocks read
                                    in place), torch's packed matmuls on CPU, and for
                                    weights neither handles, one dense GEMV per row (the
                                    original engine's row-wise fallback)
    rows >  gemv_max_rows   "gemm"  the dense matrix (dequantized per call, or from the
                                    optional dequant cache) through cuBLAS / the CPU BLAS
    batch_invariant         "gemv-invariant"  every row through the same per-row kernel
                                    whatever the batch: Triton in its M-independent
                                    configuration on CUDA, one M=1 call per row on CPU

Why the row count matters at all: the two paths round differently, and the
difference survives in the KV cache (the original's "kernel threshold changed the
text" finding); `batch_invariant` is the way to switch that off.

Every path returns the activation dtype (rounded once, like cuBLAS rounds a GEMM's
float32 accumulator), so the paths differ only in accumulation order.
"""

from __future__ import annotations

import torch

from minivllm.kernels.kernel_options import KernelOptions
from minivllm.kernels.quant_weight import QuantizedWeight
from minivllm.obs.trace import trace_scope


class QuantLinear:
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, *, options: KernelOptions,
                 compute_dtype: torch.dtype, name: str = "linear"):
        self.weight = weight
        self.bias = bias  # float32 or None
        self.options = options  # shared by every layer of a model; read at call time
        self.compute_dtype = compute_dtype
        self.name = name  # the projection, shown in traces ("attn_q", "ffn_down", ...)
        self._dense: torch.Tensor | None = None  # the dequant cache, when enabled
        self._packed = None  # CPU packed representation (cpu_packed.CpuPackedWeight) or None
        self._triton_ok = False
        device = weight.device
        if device.type == "cuda":
            from minivllm.kernels.triton.dequant_gemv import SUPPORTED_GEMV_TYPES

            self._triton_ok = weight.ggml_type in SUPPORTED_GEMV_TYPES
        elif not weight.is_float:
            from minivllm.kernels.cpu_packed import CpuPackedWeight

            self._packed = CpuPackedWeight.from_quantized(weight)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def gemv_kind(self) -> str:
        """What the GEMV path runs for this weight (shown in snapshots)."""
        if self._triton_ok:
            return f"triton-{self.weight.type_name}"
        if self._packed is not None:
            return f"cpu-{self._packed.kind}"
        return "rowwise-dense"

    # -- the dense matrix for GEMM ------------------------------------------------------

    def dense(self) -> torch.Tensor:
        """The (N, K) matrix in the compute dtype: cached when the options say so."""
        if self._dense is not None:
            return self._dense
        w = self.weight.dequantize(self.compute_dtype)
        if self.options.dequant_cache is True:
            self._dense = w
        return w

    def drop_dequant_cache(self) -> None:
        self._dense = None

    # -- dispatch -----------------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        opts = self.options
        if opts.batch_invariant:
            path = "gemv-invariant"
        elif 0 < rows <= (opts.gemv_max_rows or 0):
            path = "gemv"
        else:
            path = "gemm"
        opts.path_counts[path] += 1
        with trace_scope("qmatmul", self.name, path=path):  # which path ran, in the trace
            if path == "gemm":
                y = x.to(self.compute_dtype) @ self.dense().T
            else:
                y = self._gemv(x, invariant=path == "gemv-invariant")
            if self.bias is not None:
                y = (y.float() + self.bias).to(y.dtype)
            return y

    def _gemv(self, x: torch.Tensor, *, invariant: bool) -> torch.Tensor:
        out_dtype = self.compute_dtype
        if x.shape[0] == 0:  # a step whose rows need no logits still calls the LM head
            return x.new_empty((0, self.out_features), dtype=out_dtype)
        if self._triton_ok:
            from minivllm.kernels.triton.dequant_gemv import triton_gemv

            return triton_gemv(x.to(out_dtype).contiguous(), self.weight, invariant=invariant).to(out_dtype)
        if self._packed is not None:
            xf = x.float()
            if invariant and x.shape[0] > 1:  # one M=1 call per row: the same kernel whatever the batch
                return torch.cat([self._packed.matmul(xf[i:i + 1]) for i in range(x.shape[0])]).to(out_dtype)
            return self._packed.matmul(xf).to(out_dtype)
        # Row-wise GEMV over the dense matrix: one M=1 product per row, so every row
        # takes the same BLAS kernel whatever the batch.
        w = self.dense()
        xc = x.to(self.compute_dtype)
        return torch.cat([xc[i:i + 1] @ w.T for i in range(x.shape[0])])


class QuantEmbedding:
    """Token embedding lookup that dequantizes only the rows it is asked for."""

    def __init__(self, weight: QuantizedWeight, *, options: KernelOptions):
        self.weight = weight
        self.options = options
        self._dense: torch.Tensor | None = None

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return self._dense[token_ids]
        if self.options.dequant_cache is True and self.weight.device.type == "cpu":
            self._dense = self.weight.dequantize(torch.float32)
            return self._dense[token_ids]
        w = self.weight
        rows = w.raw[token_ids]
        from minivllm.gguf.dequant import dequantize

        return dequantize(rows.reshape(-1), w.ggml_type, (token_ids.shape[0], w.shape[1]),
                          dtype=torch.float32, tensor_name=w.name)
