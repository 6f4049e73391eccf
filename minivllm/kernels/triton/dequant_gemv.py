"""Fused dequantize-GEMV on CUDA: y = x @ W.T with W read in its GGUF block format.

One kernel skeleton serves every weight type; a per-type decoder (passed as a
compile-time function, see `gemv_legacy_quants.py`, `gemv_k_quants.py`,
`gemv_float.py`) turns the bytes of a [BLOCK_N, J, GROUP] tile into float32 weights
in registers. A program owns BLOCK_N output features and BLOCK_M activation rows and
walks K in tiles of J groups:

    acc[m, n, j, i] += w[n, j, i] * x[m, j, i]      (float32, one FMA per weight)

and reduces `acc` once at the end. The weight bytes are read from DRAM exactly once
per program (decoded once, reused for its BLOCK_M rows); there is no dequantized copy
and no `tl.dot`, so the same code runs on T4 (sm_75) and Hopper.

Row invariance (batch-invariant mode): with `invariant=True` the launch configuration
is fixed (BLOCK_M = 1, and BLOCK_N, J, num_warps per weight type only), so every row
is computed by the same compiled program with its own accumulator and the same
reduction order, whatever M is and whatever the other rows hold. Without it, configs
are chosen for speed: an autotuned set for M = 1, a multi-row program for M > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from minivllm.errors import ConfigError, DeviceError, UnsupportedTensorTypeError
from minivllm.kernels.gpu_profile import triton_interpreting
from minivllm.kernels.quant_weight import QuantizedWeight
from minivllm.kernels.triton import gemv_float, gemv_k_quants, gemv_legacy_quants

_T = GGMLQuantizationType


@dataclass(frozen=True)
class _TypeKernel:
    decode: object  # the @triton.jit decoder
    group: int  # elements per group (elements that share one scale)
    view: torch.dtype  # how the kernel sees `raw`: bytes, or the float element type


_KERNELS: dict[GGMLQuantizationType, _TypeKernel] = {
    _T.Q4_0: _TypeKernel(gemv_legacy_quants.decode_q4_0, 32, torch.uint8),
    _T.Q4_1: _TypeKernel(gemv_legacy_quants.decode_q4_1, 32, torch.uint8),
    _T.Q5_0: _TypeKernel(gemv_legacy_quants.decode_q5_0, 32, torch.uint8),
    _T.Q5_1: _TypeKernel(gemv_legacy_quants.decode_q5_1, 32, torch.uint8),
    _T.Q8_0: _TypeKernel(gemv_legacy_quants.decode_q8_0, 32, torch.uint8),
    _T.Q4_K: _TypeKernel(gemv_k_quants.decode_q4_k, 32, torch.uint8),
    _T.Q5_K: _TypeKernel(gemv_k_quants.decode_q5_k, 32, torch.uint8),
    _T.Q6_K: _TypeKernel(gemv_k_quants.decode_q6_k, 16, torch.uint8),
    _T.F32: _TypeKernel(gemv_float.decode_f32, 32, torch.float32),
    _T.F16: _TypeKernel(gemv_float.decode_f16, 32, torch.float16),
    _T.BF16: _TypeKernel(gemv_float.decode_bf16, 32, torch.int16),
}

SUPPORTED_GEMV_TYPES: frozenset[GGMLQuantizationType] = frozenset(_KERNELS)

# Elements of K per loop iteration (a multiple of 256: whole k-quant super-blocks).
# Tiles of BLOCK_N * TILE_K >= 4096 weights per 4 warps let Triton give each thread 16
# consecutive quant bytes (one 128-bit load) and decode each group's scale once per
# thread; smaller tiles spread a group over many threads that all reload its scale.
_TILE_K = 512
# Batch-invariant mode: one row per program, the same program for every M.
_INVARIANT = dict(BLOCK_M=1, BLOCK_N=8, TILE_K=_TILE_K, num_warps=4)
# M > 1 without invariance: decode each weight tile once for up to 8 rows. BLOCK_N
# shrinks as rows grow so the accumulator (BLOCK_M * BLOCK_N * TILE_K floats per
# program) stays in registers.
_MAX_BLOCK_M = 8


@triton.jit
def _dequant_gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N,
    stride_xm, stride_wn, stride_om,
    N_GROUPS: tl.constexpr,  # groups per row (K / GROUP); constexpr, see below
    DECODE: tl.constexpr, GROUP: tl.constexpr, TILE_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    J: tl.constexpr = tl.constexpr(TILE_K // GROUP)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)

    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    # int64: a large float weight (an LM head) passes 2**31 bytes.
    row_off = (rows.to(tl.int64) * stride_wn)[:, None, None]
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = (ms.to(tl.int64) * stride_xm)[:, None, None, None]
    i = tl.arange(0, GROUP)[None, None, :]
    # Loops run to N_GROUPS, a compile-time constant: a model has two or three distinct K,
    # and Triton's interpreter (the CPU test path) cannot loop up to a runtime scalar
    # under numpy 2.

    if BLOCK_M == 1:
        # One activation row: a [BLOCK_N, J, GROUP] accumulator laid out like the weight
        # tile, with x broadcast over the rows (each thread reuses its x for its rows).
        acc = tl.zeros([BLOCK_N, J, GROUP], dtype=tl.float32)
        x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
        for g0 in range(0, N_GROUPS, J):
            g = g0 + tl.arange(0, J)[None, :, None]
            g_ok = g < N_GROUPS
            w = DECODE(w_ptr, row_off, g, i, row_ok[:, None, None] & g_ok)
            x_off = tl.max_contiguous(tl.multiple_of(g * GROUP + i, [1, 1, 16]), [1, 1, GROUP])
            x = tl.load(x_row + x_off, mask=g_ok, other=0.0)
            acc += w * x.to(tl.float32)
        out = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]
    else:
        # Several rows: decode each weight tile once and use it for all of them.
        acc4 = tl.zeros([BLOCK_M, BLOCK_N, J, GROUP], dtype=tl.float32)
        for g0 in range(0, N_GROUPS, J):
            g = g0 + tl.arange(0, J)[None, :, None]
            g_ok = g < N_GROUPS
            w = DECODE(w_ptr, row_off, g, i, row_ok[:, None, None] & g_ok)
            x_off = tl.max_contiguous(tl.multiple_of((g * GROUP + i)[None], [1, 1, 1, 16]), [1, 1, 1, GROUP])
            x = tl.load(x_ptr + x_rows + x_off, mask=m_ok[:, None, None, None] & g_ok[None], other=0.0)
            acc4 += w[None] * x.to(tl.float32)  # [1, BN, J, G] * [BM, 1, J, G]
        out = tl.sum(tl.sum(acc4, axis=3), axis=2)
    tl.store(out_ptr + ms[:, None] * stride_om + rows[None, :], out, mask=m_ok[:, None] & row_ok[None, :])


def _m1_configs() -> list[triton.Config]:
    return [
        triton.Config({"BLOCK_N": bn, "TILE_K": tk}, num_warps=nw)
        for bn, tk, nw in [(4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8)]
    ]


# M = 1 is the decode step of one request, the case the GEMV path exists for: tuned
# per (N, K, weight type) on first use. (The key names the decoder, so two types of
# the same shape keep separate choices.)
_dequant_gemv_m1 = triton.autotune(configs=_m1_configs(), key=["N", "N_GROUPS", "DECODE", "GROUP"])(
    _dequant_gemv_kernel
)


def _check_inputs(x: torch.Tensor, w: QuantizedWeight) -> None:
    if w.ggml_type not in _KERNELS:
        supported = sorted(t.name for t in SUPPORTED_GEMV_TYPES)
        raise UnsupportedTensorTypeError(w.name, w.type_name, supported)
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ConfigError(f"x for {w.name!r}", tuple(x.shape), f"expected (M, {w.shape[1]}) activations")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"x dtype for {w.name!r}", x.dtype, "allowed: float32, float16, bfloat16 (sm_80+)")
    if x.device != w.raw.device:
        raise DeviceError(f"triton_gemv({w.name!r}): x is on {x.device} but the weight is on {w.raw.device}; "
                          f"move them to one device")
    if x.device.type == "cuda":
        from minivllm.kernels.gpu_profile import gpu_profile

        if x.dtype == torch.bfloat16 and not gpu_profile(x.device).bf16:
            raise DeviceError(f"triton_gemv({w.name!r}): bf16 activations need sm_80 or newer, "
                              f"{torch.cuda.get_device_name(x.device)} is older; use float16 or float32")
    elif not (x.device.type == "cpu" and triton_interpreting()):
        raise DeviceError(f"triton_gemv({w.name!r}) is a Triton GPU kernel and got {x.device} tensors; move them "
                          f"to a CUDA device (CPU tensors run only under Triton's interpreter, TRITON_INTERPRET=1)")


def triton_gemv(x: torch.Tensor, w: QuantizedWeight, *, invariant: bool = False) -> torch.Tensor:
    """x: (M, K) float32 or float16 (bf16 only on sm_80+), contiguous, on w.raw.device.

    Returns (M, N) float32 = x @ w.dequantize(float32).T computed with float32
    accumulation. `invariant=True` makes each row's result bitwise independent of M
    and of the other rows (batch-invariant mode).
    """
    _check_inputs(x, w)
    x = x.contiguous()
    spec = _KERNELS[w.ggml_type]
    n, k = w.shape
    m = x.shape[0]
    raw = w.raw if spec.view == torch.uint8 else w.raw.view(spec.view)
    out = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    args = (x, raw, out, m, n, x.stride(0), raw.stride(0), out.stride(0))
    common = dict(N_GROUPS=k // spec.group, DECODE=spec.decode, GROUP=spec.group)

    if invariant or triton_interpreting():
        # The interpreter cannot autotune (no CUDA events); it runs the fixed configs.
        cfg = dict(_INVARIANT) if invariant or m == 1 else _multi_row_config(m)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
        _dequant_gemv_kernel[grid](*args, **common, **cfg)
    elif m == 1:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), 1)  # noqa: E731
        _dequant_gemv_m1[grid](*args, **common, BLOCK_M=1)
    else:
        cfg = _multi_row_config(m)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]))
        _dequant_gemv_kernel[grid](*args, **common, **cfg)
    return out


def _multi_row_config(m: int) -> dict:
    block_m = min(triton.next_power_of_2(m), _MAX_BLOCK_M)
    return dict(BLOCK_M=block_m, BLOCK_N=max(1, 8 // block_m), TILE_K=_TILE_K, num_warps=4)
