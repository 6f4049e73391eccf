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
difference survives in the KV cache, so changing the kernel threshold can change the
generated text; `batch_invariant` is the way to switch that off.

Every path returns the activation dtype (rounded once, like cuBLAS rounds a GEMM's
float32 accumulator), so the paths differ only in accumulation order.
"""

from __future__ import annotations

import torch

from minivllm.kernels import fallbacks
from minivllm.kernels.gpu_profile import runs_gpu_path
from minivllm.kernels.kernel_options import KernelOptions, options_in_effect
from minivllm.kernels.quant_weight import QuantizedWeight
from minivllm.obs.trace import trace_scope


class QuantLinear:
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, *, options: KernelOptions,
                 compute_dtype: torch.dtype, name: str = "linear", out_dtype: torch.dtype | None = None):
        self.weight = weight
        self.bias = bias  # float32 or None
        self._default_options = options  # the model's, for calls outside a forward that names its own
        self.compute_dtype = compute_dtype  # the matmul's input dtype (GEMM, dense GEMV)
        # What the layer returns: the compute dtype, except in the CPU fast mode, whose
        # bf16 GEMM / int8 GEMV hand float32 back to a float32 model (model/loader.py).
        self.out_dtype = out_dtype or compute_dtype
        self.name = name  # the projection, shown in traces ("attn_q", "ffn_down", ...)
        self._dense: torch.Tensor | None = None  # the dequant cache, when enabled
        self._packed = None  # the low-precision CPU pack (cpu_packed.CpuPackedWeight), built on first use
        self._cpu_quant = False  # a quantized weight on the CPU: the GEMV follows options.cpu_gemv
        self._cpu_mode: tuple[str, str] | None = None  # (options.cpu_gemv, what it resolved to)
        self._gemv_args = None  # the f32 kernel's prepared arguments (cpu_gemv.prepare)
        self._q8_pack = None  # the q8 kernel's repacked blocks (cpu_gemv.pack_q8), built on first use
        self._many_args = None  # project_many's prepared kernel arguments when this is the first linear
        self._triton_ok = False
        self._repacked = None  # CUDA: the GPU layout of the blocks (kernels/triton/repacked_gemv.py)
        # The fused projection (kernels/fused_projection.py) whose weight holds this one's
        # rows, if any: then `_repacked` is a view of that weight's planes.
        self.fused = None
        device = weight.device
        if runs_gpu_path(device):
            from minivllm.kernels.triton.dequant_gemv import SUPPORTED_GEMV_TYPES

            self._triton_ok = weight.ggml_type in SUPPORTED_GEMV_TYPES
            self._repack(weight)
        elif not weight.is_float:
            self._cpu_quant = True

    @property
    def options(self) -> KernelOptions:
        """The kernel options of the forward running now (`DecoderModel.forward_batch`'s
        `options`), else the model's defaults: read per call, never stored."""
        return options_in_effect(self._default_options)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def gemv_kind(self) -> str:
        """What the GEMV path runs for this weight (shown in snapshots)."""
        if self._repacked is not None and _cuda_kernel_usable(self._repacked_key()):
            return f"triton-repacked-{self.weight.type_name}"
        if self._repacked is not None:
            return f"dequant-cublas-{self.weight.type_name}"  # the Triton kernel failed to compile here
        if self._triton_ok:
            return f"triton-{self.weight.type_name}"
        if self._cpu_quant:
            from minivllm.kernels import cpu_gemv
            from minivllm.kernels.cpu_packed import packed_kind

            mode = self.cpu_gemv_mode()
            if mode == "f32":
                return f"cpu-f32-{cpu_gemv.isa()}"  # the compiled kernel: float32 in, float32 sums
            if mode == "q8":
                return f"cpu-q8-{cpu_gemv.isa()}"  # int8 activations, integer dot products
            if mode == "lowp":
                return f"cpu-lowp-{self._packed.kind if self._packed is not None else packed_kind(self.weight)}"
            return f"cpu-{str(self.compute_dtype).replace('torch.', '')}-torch"  # dense GEMV in the activation dtype
        return "rowwise-dense"

    def cpu_gemv_mode(self) -> str:
        """What this CPU weight's GEMV runs under the current options: "f32" (the compiled
        float32 kernel), "q8" (int8 activations, the packed VNNI kernel), "lowp" (the
        low-precision packs) or "torch" (the dense matrix in the activation dtype: types the
        kernel lacks, or no kernel on this machine)."""
        asked = self.options.cpu_gemv
        if self._cpu_mode is not None and self._cpu_mode[0] == asked:
            return self._cpu_mode[1]
        mode = asked
        if mode == "auto":
            mode = "q8" if self.compute_dtype == torch.bfloat16 else "f32"
        if mode == "q8":
            from minivllm.kernels import cpu_gemv

            # Q8_0 already streams at the memory's speed through the float32 kernel (the
            # q8 kernels were 0.6-0.85x on it), and the K-quants have no int8 kernel here:
            # both keep float32 in the fast mode.
            if cpu_gemv.extension() is None or self.weight.ggml_type not in cpu_gemv.Q8_PACKED_TYPES:
                mode = "f32"
        if mode == "f32":
            from minivllm.kernels import cpu_gemv

            if self.weight.ggml_type not in cpu_gemv.F32_GEMV_TYPES or cpu_gemv.extension() is None:
                mode = "torch"
        self._cpu_mode = (asked, mode)
        return mode

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

    def path(self, rows: int) -> str:
        """The path a call with `rows` activation rows takes under the options in effect."""
        opts = self.options
        if opts.batch_invariant:
            return "gemv-invariant"
        if 0 < rows <= (opts.gemv_max_rows or 0):
            return "gemv"
        return "gemm"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward(x, defer_split_sum=False)

    def partials(self, x: torch.Tensor):
        """This layer's output for a consumer that sums split-K slices itself
        (`triton.fused.add_rms_norm`): where the GPU GEMV splits K, its unsummed
        `split_sum.SplitPartials` (one launch fewer); elsewhere the same tensor as
        calling the layer."""
        return self._forward(x, defer_split_sum=True)

    def _forward(self, x: torch.Tensor, *, defer_split_sum: bool):
        path = self.path(x.shape[0])
        self.options.path_counts[path] += 1
        with trace_scope("qmatmul", self.name, path=path):  # which path ran, in the trace
            if path == "gemm" and self.weight.device.type == "cpu":
                from minivllm.kernels.cpu_gemm import matmul_nt

                y = matmul_nt(x.to(self.compute_dtype).contiguous(), self.dense()).to(self.out_dtype)
            elif path == "gemm":
                y = x.to(self.compute_dtype) @ self.dense().T
            elif self._repacked is not None and x.shape[0] > 0:
                y = self._repacked_gemv(x, invariant=path == "gemv-invariant", defer_split_sum=defer_split_sum)
                if y is not None:
                    return y  # the bias is added inside the kernel, before its one rounding
                y = self._dense_rows(x)  # the kernel failed to compile on this device (warned once)
            else:
                y = self._gemv(x, invariant=path == "gemv-invariant")
            if self.bias is not None:
                y = (y.float() + self.bias).to(y.dtype)
            return y

    def _gemv(self, x: torch.Tensor, *, invariant: bool) -> torch.Tensor:
        out_dtype = self.out_dtype
        if x.shape[0] == 0:  # a step whose rows need no logits still calls the LM head
            return x.new_empty((0, self.out_features), dtype=out_dtype)
        if self._triton_ok:
            from minivllm.kernels.triton.dequant_gemv import triton_gemv

            return triton_gemv(x.to(out_dtype).contiguous(), self.weight, invariant=invariant).to(out_dtype)
        if self._cpu_quant:
            mode = self.cpu_gemv_mode()
            if mode == "f32":
                from minivllm.kernels import cpu_gemv

                # Each row's sum order is fixed by K alone (cpu_gemv.cpp), so one call
                # over every row is already batch-invariant.
                if self._gemv_args is None:
                    self._gemv_args = cpu_gemv.prepare([self.weight])
                y = cpu_gemv.run(x if x.dtype == torch.float32 else x.float(), self._gemv_args)[0]
                return y if out_dtype == torch.float32 else y.to(out_dtype)
            if mode == "q8":
                from minivllm.kernels import cpu_gemv

                y = cpu_gemv.run_q8_weights(x if x.dtype == torch.float32 else x.float(), [self])[0]
                return y if out_dtype == torch.float32 else y.to(out_dtype)
            if mode == "lowp":
                packed = self._lowp()
                xf = x.float()
                if invariant and x.shape[0] > 1:  # one M=1 call per row: the same kernel whatever the batch
                    return torch.cat([packed.matmul(xf[i:i + 1]) for i in range(x.shape[0])]).to(out_dtype)
                return packed.matmul(xf).to(out_dtype)
        return self._dense_rows(x)

    def _dense_rows(self, x: torch.Tensor) -> torch.Tensor:
        # Row-wise GEMV over the dense matrix: one M=1 product per row, so every row
        # takes the same BLAS kernel whatever the batch.
        w = self.dense()
        xc = x.to(self.compute_dtype)
        return torch.cat([xc[i:i + 1] @ w.T for i in range(x.shape[0])])

    # -- CUDA: the repacked-layout GEMV ---------------------------------------------------

    def _repack(self, weight: QuantizedWeight) -> None:
        """Keep the blocks in the GPU layout only (memory about the file size). A weight
        shared with the embedding (a tied LM head) keeps its file blocks there too."""
        import os

        if os.environ.get("MINIVLLM_REPACKED_GEMV", "1") == "0":
            return
        try:
            from minivllm.kernels.repacked_layout import REPACKED_TYPES, repack
            from minivllm.kernels.triton.repacked_gemv import RepackedQuantizedWeight
        except ImportError:  # no Triton: the dense path below serves every call
            return
        if isinstance(weight, RepackedQuantizedWeight):  # already in the GPU layout (a fused projection's)
            self._repacked = weight.repacked
            return
        if weight.ggml_type not in REPACKED_TYPES:
            return
        self._repacked = repack(weight)
        self.weight = RepackedQuantizedWeight(self._repacked)

    @property
    def repacked(self):
        """The weight in the GPU layout (`repacked_layout.RepackedWeight`), or None."""
        return self._repacked

    def take_rows_of(self, fused, row0: int, group) -> None:
        """Hold rows row0.. of the fused weight `fused` as views instead of a copy of one's
        own (the fused projection `group` replaces this weight on the device)."""
        from minivllm.kernels.repacked_layout import row_range
        from minivllm.kernels.triton.repacked_gemv import RepackedQuantizedWeight

        self._repacked = row_range(fused, row0, self.out_features, self.name)
        self.weight = RepackedQuantizedWeight(self._repacked)
        self._dense = None
        self.fused = group

    def _repacked_key(self) -> tuple:
        return (self.weight.type_name, self.weight.shape[1], self.compute_dtype)

    def kernel_key(self) -> tuple:
        """(type, K, compute dtype): what a repacked kernel's compile success depends on."""
        return self._repacked_key()

    def kernel_usable(self) -> bool:
        """Whether the repacked GEMV has not failed to compile for this weight's key here."""
        return _cuda_kernel_usable(self._repacked_key())

    def _repacked_gemv(self, x: torch.Tensor, *, invariant: bool, defer_split_sum: bool = False):
        """The repacked GEMV (its `SplitPartials` where asked and K is split), or None where
        Triton cannot compile it for this device (then this and every later call take
        dequantize + cuBLAS, after one warning)."""
        from minivllm.kernels.triton.repacked_gemv import repacked_gemv

        key = self._repacked_key()
        if fallbacks.failed("repacked_gemv", key):
            return None
        if key in _CUDA_KERNEL_OK:
            return repacked_gemv(x, self._repacked, invariant=invariant, out_dtype=self.compute_dtype, bias=self.bias,
                                 defer_split_sum=defer_split_sum)
        try:
            y = repacked_gemv(x, self._repacked, invariant=invariant, out_dtype=self.compute_dtype, bias=self.bias,
                              defer_split_sum=defer_split_sum)
        except Exception as exc:  # a Triton compile/launch failure on this GPU (e.g. sm_75 on a newer Triton)
            fallbacks.record("repacked_gemv", key, x.device, exc,
                             f"{self.weight.type_name} layers fall back to dequantize + cuBLAS")
            return None
        _CUDA_KERNEL_OK.add(key)
        return y

    def q8_args(self) -> tuple:
        """This weight's arguments for the q8 kernel: its repacked planes where the build
        has the AVX512-VNNI kernel, else the file's blocks (made once)."""
        if self._q8_pack is None:
            from minivllm.kernels import cpu_gemv

            self._q8_pack = cpu_gemv.q8_weight_args(self.weight)
        return self._q8_pack

    def _lowp(self):
        if self._packed is None:
            from minivllm.kernels.cpu_packed import CpuPackedWeight

            self._packed = CpuPackedWeight.from_quantized(self.weight)
        return self._packed


# (type, K, compute dtype) of the repacked-GEMV kernels that ran here (failures: fallbacks.py).
_CUDA_KERNEL_OK: set[tuple] = set()


def _cuda_kernel_usable(key: tuple) -> bool:
    return not fallbacks.failed("repacked_gemv", key)


def project_many(linears, x: torch.Tensor) -> list[torch.Tensor]:
    """[lin(x) for lin in linears] for projections of one input (a layer's Q/K/V, or its
    gate/up): on a CPU whose weights all take the float32 kernel's GEMV path, one kernel
    call over all their rows (one parallel region and one Python round trip instead of
    several). The arithmetic is each projection's own, so the results are the same bits
    as separate calls; anything else falls back to separate calls. On the GPU path,
    linears that share a fused weight (`kernels/fused_projection.py`) take one GEMV per
    fused run, their outputs views of one tensor."""
    first = linears[0]
    opts = first.options
    rows = x.shape[0]
    mode = first.cpu_gemv_mode() if first._cpu_quant else None
    fused = (mode in ("f32", "q8") and not opts.batch_invariant and 0 < rows <= (opts.gemv_max_rows or 0)
             and all(lin._cpu_quant and lin.cpu_gemv_mode() == mode and lin.options is opts for lin in linears))
    if not fused:
        call = _through_fused if any(lin.fused is not None for lin in linears) else _each
        if x.is_cuda and first._repacked is not None:
            from minivllm.kernels.triton.q8_gemv import sharing_quantization

            with sharing_quantization(x):  # the int8 GEMVs of x quantize it once
                return call(linears, x)
        return call(linears, x)
    from minivllm.kernels import cpu_gemv

    cached = first._many_args  # (linears, mode, kernel arguments, trace name), made on the first call
    if cached is None or cached[0] != tuple(linears) or cached[1] != mode:
        linears = tuple(linears)
        args = cpu_gemv.prepare([lin.weight for lin in linears]) if mode == "f32" else linears
        cached = first._many_args = (linears, mode, args, "+".join(lin.name for lin in linears))
    opts.path_counts["gemv"] += len(linears)
    with trace_scope("qmatmul", cached[3], path="gemv"):
        xf = x if x.dtype == torch.float32 else x.float()
        ys = cpu_gemv.run(xf, cached[2]) if mode == "f32" else cpu_gemv.run_q8_weights(xf, cached[2])
        out = []
        for lin, y in zip(linears, ys):  # no-op .to calls skipped: ~3 µs each, 150 a step
            if lin.bias is not None:
                y = y.add_(lin.bias)
            out.append(y if lin.out_dtype == torch.float32 else y.to(lin.out_dtype))
        return out


def _each(linears, x: torch.Tensor) -> list[torch.Tensor]:
    return [lin(x) for lin in linears]


def _through_fused(linears, x: torch.Tensor) -> list[torch.Tensor]:
    """project_many where runs of the linears share a fused weight: one GEMV per run
    (its outputs are views of one tensor), one per linear elsewhere."""
    out, i = [], 0
    while i < len(linears):
        group = linears[i].fused
        if group is not None and tuple(linears[i:i + len(group.parts)]) == group.parts:
            out.extend(group(x))
            i += len(group.parts)
        else:
            out.append(linears[i](x))
            i += 1
    return out


class QuantEmbedding:
    """Token embedding lookup that dequantizes only the rows it is asked for."""

    def __init__(self, weight: QuantizedWeight, *, options: KernelOptions):
        self.weight = weight
        self._default_options = options
        self._dense: torch.Tensor | None = None

    @property
    def options(self) -> KernelOptions:
        return options_in_effect(self._default_options)

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
