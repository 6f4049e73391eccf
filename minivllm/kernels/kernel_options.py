"""How the model's matmuls and attention pick kernels: one object shared by every layer.

The engine owns it and changes it between steps (e.g. a `debug.compare` run with
different thresholds), so layers read it at call time instead of copying values.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from minivllm.errors import ConfigError


@dataclass
class KernelOptions:
    # Inputs with at most this many rows take the fused dequantize-GEMV path (one
    # kernel per row set, weights read in block format); more rows dequantize and GEMM.
    # 0 disables GEMV. None: the device default (see `default_gemv_max_rows`).
    gemv_max_rows: int | None = None
    # Keep a dequantized copy of every quantized weight for the GEMM path ("auto": on
    # CPU always; on CUDA when the dense copies take at most half the free memory;
    # True/False force it).
    dequant_cache: bool | str = "auto"
    # Every row's arithmetic independent of the batch, chunking and gemv_max_rows.
    batch_invariant: bool = False
    # What the GEMV path runs on a CPU (CPU_GEMV_MODES): "auto" is the float32 kernel
    # (cpu_gemv.cpp: float32 activations, float32 accumulation) unless the model's
    # activation dtype is bfloat16, which selects "lowp"; "f32" that kernel whatever the
    # dtype; "torch" the pure-torch dense GEMM in the activation dtype (what runs when
    # the kernel cannot be built); "lowp" the low-precision packs (cpu_packed.py: bf16
    # activations and scales for 4-bit types, f16 weights and activations otherwise).
    cpu_gemv: str = "auto"
    # Per-path call counts since the last reset; shown in the engine snapshot.
    path_counts: Counter = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.gemv_max_rows is not None and not (isinstance(self.gemv_max_rows, int) and self.gemv_max_rows >= 0):
            raise ConfigError("gemv_max_rows", self.gemv_max_rows, "must be an integer >= 0 (0 disables the GEMV path)")
        if self.dequant_cache not in (True, False, "auto"):
            raise ConfigError("dequant_cache", self.dequant_cache, "allowed: True, False, 'auto'")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError("batch_invariant", self.batch_invariant, "must be True or False")
        if self.cpu_gemv not in CPU_GEMV_MODES:
            raise ConfigError("cpu_gemv", self.cpu_gemv, f"allowed: {', '.join(CPU_GEMV_MODES)}")

    def resolved(self, device, dense_bytes: int | None = None) -> "KernelOptions":
        """A copy with device defaults filled in (None / "auto" replaced). `dense_bytes`:
        what dequantized copies of the model's projections would take."""
        import torch

        device = torch.device(device)
        rows = self.gemv_max_rows if self.gemv_max_rows is not None else default_gemv_max_rows(device)
        cache = self.dequant_cache
        if cache == "auto":
            # CPU: the BLAS GEMM needs the dense matrix and host memory is plentiful next
            # to a model file, so cache. CUDA: dequantizing every weight in every prefill
            # forward cost a synthetic 7B Q4_K_M ~0.5 s per step on an H200, whatever the
            # chunk length, so cache when the copies fit in half the free memory (a 7B
            # on an H200, a 0.5B on a T4); otherwise memory stays about the file size and
            # GEMM dequantizes one weight at a time.
            if device.type == "cpu":
                cache = True
            else:
                cache = dense_bytes is not None and dense_bytes <= torch.cuda.mem_get_info(device)[0] // 2
        if self.gemv_max_rows is None and device.type == "cuda" and cache is True:
            # With dense copies on the device, cuBLAS wins from two rows on: the Triton
            # GEMV decodes the weights once per row (H200, Qwen2.5-7B ffn 18944x3584 Q4_K:
            # 338 us at M=8 vs 47 us for the f16 cuBLAS GEMV, benchmarks/results/
            # h200-kernels-gemv-20261201T225533Z; bench decode at batch 8 was 718 tok/s
            # with GEMM vs 226 with GEMV, ../shared/peers/README.md). Without the cache
            # (a T4), GEMM would dequantize every weight per call, so GEMV keeps 8 rows.
            rows = 1
        return KernelOptions(gemv_max_rows=rows, dequant_cache=cache, batch_invariant=self.batch_invariant,
                             cpu_gemv=self.cpu_gemv)

    def assign(self, other: "KernelOptions") -> None:
        """Take `other`'s settings in place (every layer holds a reference to self)."""
        self.gemv_max_rows = other.gemv_max_rows
        self.dequant_cache = other.dequant_cache
        self.batch_invariant = other.batch_invariant
        self.cpu_gemv = other.cpu_gemv

    def describe(self) -> dict:
        return {"gemv_max_rows": self.gemv_max_rows, "dequant_cache": self.dequant_cache,
                "batch_invariant": self.batch_invariant, "cpu_gemv": self.cpu_gemv}


CPU_GEMV_MODES = ("auto", "f32", "torch", "lowp")


def default_gemv_max_rows(device) -> int:
    """Rows up to which GEMV beats GEMM, per device kind.

    Chosen from `minivllm bench gemv-threshold` (benchmarks/results/*gemv-threshold*):
    the largest concurrency at which batched row-wise GEMV still matched batched GEMM.
    """
    return _DEFAULT_GEMV_MAX_ROWS.get(getattr(device, "type", str(device)), 4)


# Both from `bench gemv-threshold` on smollm2-135m, where batched row-wise GEMV beat batched
# GEMM at every N measured, so the default is the largest N measured (8):
#   cuda: h200-gemv-threshold-smollm2-135m-20261130T222044Z (GEMV/GEMM 1.66x at N=8, f16);
#   cpu:  gemv-threshold-smollm2-135m-20261130T221716Z (1.48x at N=8, 2 threads). The
#         per-shape micro-benchmark (scripts/cpu_packed_microbench.py) puts the int4
#         crossover at 16-24 rows, the f16 one (Q8_0 LM head) at 2-4.
_DEFAULT_GEMV_MAX_ROWS = {"cuda": 8, "cpu": 8}
