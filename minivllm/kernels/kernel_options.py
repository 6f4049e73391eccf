"""How the model's matmuls and attention pick kernels: options given per forward call.

Each engine holds its own resolved `KernelOptions` and passes them to every forward it
runs (`DecoderModel.forward_batch(..., options=)`); for the duration of that call they
are the options in effect (`options_in_effect`, a context variable, so two engines over
one model, or two threads, never see each other's). Layers read them at call time;
outside any forward they fall back to the model's defaults (the loader's).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields

from minivllm.errors import ConfigError
from minivllm.option_field import check_choices, option

CPU_GEMV_MODES = ("auto", "f32", "q8", "torch", "lowp")


@dataclass
class KernelSettings:
    """The kernel choices a user sets (also fields of `EngineConfig`, which inherits them)."""

    gemv_max_rows: int | None = option(
        None, "rows up to which the fused dequantize-GEMV runs (one kernel per row set, weights read in block "
        "format); more rows dequantize and GEMM. 0 = never; default: per device", "kernels")
    dequant_cache: bool | str = option(
        "auto", "keep a dequantized copy of every quantized weight for the GEMM path (auto: on CPU always, on "
        "CUDA when the copies take at most half the free memory)", "kernels")
    batch_invariant: bool = option(
        False, "every row's arithmetic independent of the batch, chunking and gemv_max_rows (slower)", "kernels")
    cpu_gemv: str = option(
        "auto", "what a CPU GEMV runs: auto = the float32 kernel (float32 activations and accumulation) unless "
        "the activation dtype is bfloat16, which selects q8; f32 = that kernel whatever the dtype; q8 = "
        "activations rounded to int8 per block of 32 (as llama.cpp does) and integer dot products, for "
        "Q4_0/Q4_1/Q5_0 weights (the other types take the float32 kernel); torch = the pure-torch dense GEMM "
        "in the activation dtype (what runs when the kernel cannot be built); lowp = the older low-precision "
        "packs (bf16 activations and scales for 4-bit types, f16 otherwise)", "kernels",
        choices=CPU_GEMV_MODES)

    def __post_init__(self) -> None:
        if self.gemv_max_rows is not None and not (isinstance(self.gemv_max_rows, int) and self.gemv_max_rows >= 0):
            raise ConfigError("gemv_max_rows", self.gemv_max_rows, "must be an integer >= 0 (0 disables the GEMV path)")
        if self.dequant_cache not in (True, False, "auto"):
            raise ConfigError("dequant_cache", self.dequant_cache, "allowed: True, False, 'auto'")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError("batch_invariant", self.batch_invariant, "must be True or False")
        check_choices(self)

    def kernel_settings(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(KernelSettings)}


@dataclass
class KernelOptions(KernelSettings):
    """The settings plus what the layers record while they run."""

    # Per-path call counts since the last reset; shown in the engine snapshot.
    path_counts: Counter = field(default_factory=Counter)

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
            # with GEMM vs 226 with GEMV on the same H200, 7B Q4_K_M). Without the cache
            # (a T4), GEMM would dequantize every weight per call, so GEMV keeps 8 rows.
            rows = 1
        return KernelOptions(**{**self.kernel_settings(), "gemv_max_rows": rows, "dequant_cache": cache})

    def assign(self, other: "KernelOptions") -> None:
        """Take `other`'s settings in place (every layer holds a reference to self)."""
        for name, value in other.kernel_settings().items():
            setattr(self, name, value)

    def describe(self) -> dict:
        return self.kernel_settings()



_IN_EFFECT: ContextVar[KernelOptions | None] = ContextVar("minivllm_kernel_options", default=None)


@contextmanager
def kernel_options_for_call(options: KernelOptions) -> Iterator[KernelOptions]:
    """Make `options` the ones in effect for the block (one forward), then restore the
    previous ones: nothing shared is written."""
    token = _IN_EFFECT.set(options)
    try:
        yield options
    finally:
        _IN_EFFECT.reset(token)


def options_in_effect(default: KernelOptions) -> KernelOptions:
    """The options of the forward running now in this context, else `default`."""
    current = _IN_EFFECT.get()
    return default if current is None else current


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
