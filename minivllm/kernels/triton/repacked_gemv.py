"""GEMV over the repacked layout of `kernels/repacked_layout.py` (the planes, the row
interleave and the field order are described there).

Decoding without int->float conversions (I2F runs at 1/8 of the FMA rate on sm_80+):
the code of field p is masked in place and OR-ed into the mantissa of 2^(23 - 4p') (or
2^(23 - 8p') for bytes), then the constant is subtracted in float32, which is exact:

    bits(2^(23 - 4p')) | (q << 4p')  ==  2^(23 - 4p') + q      (q << 4p' < 2^23)

so a weight costs one LOP3, one FADD (which also removes the type's offset: 8, 16, 32,
128) and one FFMA; group scales are applied once per 8 (or 4) weights, mins once per
group through the group's activation sum. Only integer ops and float32 arithmetic: no
`tl.dot`, no bf16 arithmetic, so it compiles for sm_75 (T4) as for Hopper.

Each (activation row, row group) is one program that walks the whole K, with a fixed
launch configuration when `invariant=True`: a row's result is then bitwise independent
of M and of the other rows (batch-invariant mode).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from minivllm.errors import ConfigError, DeviceError
from minivllm.kernels.gemv_configs import GEMV_KERNEL_ENV
from minivllm.kernels.gpu_profile import triton_interpreting
from minivllm.kernels.quant_weight import QuantizedWeight
from minivllm.kernels.repacked_layout import PLANE_ORDER, REPACKED_TYPES, R, RepackedWeight, repack, unpack_raw  # noqa: F401 (re-exported)
from minivllm.kernels.triton.repacked_decode import decode_field, group_scales, high_fields, scaled_sum

_T = GGMLQuantizationType

# --- the kernel ---------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M", "stride_xk"])
def _repacked_gemv_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_xk, stride_om,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_G: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # Activation rows vary fastest, so the M programs of one row group run together and
    # all but the first find its weights in L2.
    pid = tl.program_id(0)
    pid_m = pid % M
    nb = pid // M  # int32 offsets: a plane holds far fewer than 2**31 elements
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, T)
    offs_r = tl.arange(0, RR)
    g3 = offs_g[:, None, None]
    t3 = offs_t[None, :, None]
    r3 = offs_r[None, None, :]
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
    for g0 in range(0, N_GROUPS, BLOCK_G):
        gg = g0 + g3
        g_ok = gg < N_GROUPS
        # Per-(group, row) planes are read through [G, T, R] pointers (t stride 0): the same
        # shape and contiguity as the weight tile, hence the same register layout.
        gr = (nb * N_GROUPS + gg) * RR + r3 + t3 * 0
        w = tl.load(q_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0)
        # Activations of field p of every word: x[g*32 + p*T + t], one per (g, t), shared by
        # the R rows. stride_xk is a runtime value, so each thread loads its own element in
        # the slice layout of the weight tile (no layout conversion).
        g2 = g0 + offs_g[:, None]
        x_off = (g2 * 32 + offs_t[None, :]) * stride_xk
        x_ok = g2 < N_GROUPS
        w_hi = w >> 16
        h_lo = w  # unused by the types without a high-bit plane
        h_hi = w
        if KIND == 5:  # Q6_K: 2-bit plane, word-shaped
            h = tl.load(b_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0).to(tl.int32)
            h_lo, h_hi = high_fields(h, KIND)
        elif KIND == 2:  # Q5_0: the fifth bits of the group, element (p, t) at 16(p//4) + 4(p%4) + t
            h_lo, h_hi = high_fields(tl.load(b_ptr + gr, mask=g_ok, other=0) >> t3, KIND)
        ps = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
        ps_hi = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
        sx = tl.zeros([BLOCK_G, T], dtype=tl.float32)
        for p in tl.static_range(32 // T):
            xp = tl.load(x_row + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
            f = decode_field(w, w_hi, h_lo, h_hi, p, KIND)
            if KIND == 1:
                sx += xp
            elif KIND == 4:
                sx += xp
            if KIND == 5:  # two 16-element scales per group
                if p < 4:
                    ps += f * xp[:, :, None]
                else:
                    ps_hi += f * xp[:, :, None]
            else:
                ps += f * xp[:, :, None]
        sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r3 + t3 * 0  # per-(super-block, row) planes
        d, m, s_lo, s_hi = group_scales(a_ptr, b_ptr, c_ptr, e_ptr, gr, sb, g_ok, KIND)
        acc += scaled_sum(ps, ps_hi, sx[:, :, None], d, m, s_lo, s_hi, KIND)
    y = tl.sum(tl.sum(acc, axis=1), axis=0)  # [R]
    rows = nb * RR + offs_r
    r_ok = rows < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=r_ok, other=0.0)
    tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=r_ok)


@triton.jit(do_not_specialize=["M", "stride_xk"])
def _repacked_gemv_rows_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_xk, stride_om,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """`_repacked_gemv_kernel` for BLOCK_M activation rows at once: each weight field is
    decoded once and multiplied into every row (the one-row kernel decodes it once per
    row, which on a T4 makes batched decode arithmetic-bound)."""
    pid = tl.program_id(0)
    n_mb = tl.cdiv(M, BLOCK_M)
    mb = pid % n_mb
    nb = pid // n_mb
    offs_g = tl.arange(0, BLOCK_G)
    g3 = offs_g[:, None, None]
    t3 = tl.arange(0, T)[None, :, None]
    r3 = tl.arange(0, RR)[None, None, :]
    ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = x_ptr + (ms.to(tl.int64) * stride_xm)[:, None, None]  # [BM, 1, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
    for g0 in range(0, N_GROUPS, BLOCK_G):
        gg = g0 + g3
        g_ok = gg < N_GROUPS
        gr = (nb * N_GROUPS + gg) * RR + r3 + t3 * 0
        w = tl.load(q_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0)
        g2 = (g0 + offs_g[:, None])[None]  # [1, G, 1]
        x_off = (g2 * 32 + tl.arange(0, T)[None, None, :]) * stride_xk  # [1, G, T]
        x_ok = m_ok[:, None, None] & (g2 < N_GROUPS)
        w_hi = w >> 16
        h_lo = w  # unused by the types without a high-bit plane
        h_hi = w
        if KIND == 5:
            h = tl.load(b_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0).to(tl.int32)
            h_lo, h_hi = high_fields(h, KIND)
        elif KIND == 2:
            h_lo, h_hi = high_fields(tl.load(b_ptr + gr, mask=g_ok, other=0) >> t3, KIND)
        ps = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
        ps_hi = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
        sx = tl.zeros([BLOCK_M, BLOCK_G, T], dtype=tl.float32)
        for p in tl.static_range(32 // T):
            xp = tl.load(x_rows + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
            f = decode_field(w, w_hi, h_lo, h_hi, p, KIND)
            if KIND == 1:
                sx += xp
            elif KIND == 4:
                sx += xp
            if KIND == 5:
                if p < 4:
                    ps += f[None] * xp[:, :, :, None]
                else:
                    ps_hi += f[None] * xp[:, :, :, None]
            else:
                ps += f[None] * xp[:, :, :, None]
        sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r3 + t3 * 0
        d, m, s_lo, s_hi = group_scales(a_ptr, b_ptr, c_ptr, e_ptr, gr, sb, g_ok, KIND)
        acc += scaled_sum(ps, ps_hi, sx[:, :, :, None], d[None], m[None], s_lo[None], s_hi[None], KIND)
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BM, R]
    rows = nb * RR + tl.arange(0, RR)
    r_ok = rows < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=r_ok, other=0.0)[None, :]
    o = out_ptr + (ms.to(tl.int64) * stride_om)[:, None] + rows[None, :]
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


# Fixed configuration (invariant mode, the interpreter, and any M): BLOCK_G groups of 32
# elements per loop trip. 64 groups x 4 rows x 16 B = 4 KB of weights per trip (Q4_K).
_FIXED = dict(BLOCK_G=64, num_warps=4)


def _autotuned_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_G": bg}, num_warps=nw) for bg, nw in [(32, 2), (64, 4), (128, 4), (128, 8), (64, 2)]]


_repacked_gemv_tuned = triton.autotune(configs=_autotuned_configs(), key=["N", "N_GROUPS", "KIND"])(
    _repacked_gemv_kernel
)


def repacked_gemv(x: torch.Tensor, w: RepackedWeight, *, invariant: bool = False, out_dtype: torch.dtype | None = None,
                  bias: torch.Tensor | None = None, autotune: bool = True, defer_split_sum: bool = False):
    """y = x @ W.T (+ bias) with float32 accumulation, rounded once to `out_dtype`
    (default float32). x: (M, K) float32/float16 (bf16 on sm_80+), on w's device.
    `invariant=True`: a fixed configuration, so each row's result is bitwise
    independent of M and of the other rows. `defer_split_sum`: where the kernel splits
    K, the unsummed `split_sum.SplitPartials` instead of y (a tensor everywhere else)."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ConfigError(f"x for {w.name!r}", tuple(x.shape), f"expected (M, {k}) activations")
    if x.device != w.device:
        raise DeviceError(f"repacked_gemv({w.name!r}): x is on {x.device} but the weight is on {w.device}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and triton_interpreting()):
        raise DeviceError(f"repacked_gemv({w.name!r}) is a Triton GPU kernel and got {x.device} tensors; move "
                          f"them to a CUDA device (CPU tensors run only under TRITON_INTERPRET=1)")
    m = x.shape[0]
    from minivllm.kernels.gemv_configs import lookup
    from minivllm.kernels.gpu_profile import gpu_profile
    from minivllm.kernels.triton import q8_gemv as q8
    from minivllm.kernels.triton.mma_gemv import mma_gemv, mma_gemv_applies, mma_launch

    profile = gpu_profile(x.device)
    # Launch shapes come from the GPU's table and depend on the weight's type and shape
    # only, so these kernels are also the batch-invariant ones.
    if _int8_path(x, w):
        config = lookup(profile.table_key, w.ggml_type.name, n, k, profile.sm_count, int8=True)
        return q8.q8_gemv(x, w, config, out_dtype=out_dtype, bias=bias, defer_split_sum=defer_split_sum)
    config = tiled_config(x, w, invariant=invariant)
    if config is not None and mma_gemv_applies(x, w):  # opt-in: MINIVLLM_GEMV_KERNEL=mma
        block_nb, split = mma_launch(n, k, profile.sm_count)
        return mma_gemv(x, w, block_nb=block_nb, split=split, out_dtype=out_dtype, bias=bias,
                        defer_split_sum=defer_split_sum)
    if config is not None:
        from minivllm.kernels.triton.tiled_gemv import tiled_gemv

        return tiled_gemv(x, w, config, out_dtype=out_dtype, bias=bias, defer_split_sum=defer_split_sum)
    if _multirow_path(x, invariant):  # 2-8 rows: each weight tile decoded once for all of them
        from minivllm.kernels.triton.multirow_gemv import multirow_gemv

        split = lookup(profile.table_key, w.ggml_type.name, n, k, profile.sm_count).split
        return multirow_gemv(x, w, split=split, out_dtype=out_dtype, bias=bias, defer_split_sum=defer_split_sum)
    out = torch.empty((m, n), dtype=out_dtype or torch.float32, device=x.device)
    if m == 0:
        return out
    names = PLANE_ORDER[w.ggml_type.name]
    ptrs = [w.planes[nm] if nm is not None else w.qs for nm in names]
    has_bias = bias is not None
    args = (x, w.qs, *ptrs, bias if has_bias else out, out, m, n, x.stride(0), x.stride(1), out.stride(0))
    common = dict(N_GROUPS=k // 32, KIND=w.kind, T=w.words_per_group, RR=R, HAS_BIAS=has_bias)
    if m > 1 and not invariant and os.environ.get("MINIVLLM_GEMV_ROWS", "1") != "0":
        # Several rows: decode each weight field once for up to 8 of them.
        block_m = min(triton.next_power_of_2(m), 8)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, R),)
        # BLOCK_G from ptxas (sm_90 / sm_75, Q4_K and Q6_K): 8 rows x 16 groups ~136 / 128
        # registers, 4 x 32 ~106-128, no spills; larger tiles pass 190.
        _repacked_gemv_rows_kernel[grid](*args, **common, BLOCK_G=16 if block_m == 8 else 32, BLOCK_M=block_m,
                                         num_warps=4)
        return out
    grid = (m * triton.cdiv(n, R),)
    if invariant or triton_interpreting() or not autotune:
        _repacked_gemv_kernel[grid](*args, **common, **_FIXED)
    else:
        _repacked_gemv_tuned[grid](*args, **common)
    return out


def _int8_path(x: torch.Tensor, w: RepackedWeight) -> bool:
    """int8 activations + dp4a: opt-in (gpu_profile.int8_gemv), for half-precision
    activations only: float32 means float32 (the reference path, and what the f32 tests pin)."""
    from minivllm.kernels.gpu_profile import gpu_profile
    from minivllm.kernels.triton import q8_gemv as q8

    return gpu_profile(x.device).int8_gemv and x.dtype != torch.float32 and w.ggml_type in q8.Q8_TYPES


def _multirow_path(x: torch.Tensor, invariant: bool) -> bool:
    """`multirow_gemv` for 2 to MAX_ROWS rows outside batch-invariant mode (where each row's
    bits must not depend on the others, so the tiled kernel runs a row at a time), unless
    MINIVLLM_GEMV_KERNEL=legacy asks for the legacy kernels."""
    from minivllm.kernels.triton.multirow_gemv import MAX_ROWS

    return (1 < x.shape[0] <= MAX_ROWS and not invariant
            and os.environ.get(GEMV_KERNEL_ENV, "tiled") != "legacy")


def tiled_config(x: torch.Tensor, w: RepackedWeight, *, invariant: bool):
    """The tiled kernel's launch shape (`gemv_configs.GemvConfig`) where `repacked_gemv`
    runs the tiled kernel for x (one row, or batch-invariant mode, not the int8 path),
    else None."""
    if _int8_path(x, w) or not (x.shape[0] == 1 or invariant):
        return None
    if os.environ.get(GEMV_KERNEL_ENV, "tiled") == "legacy":
        return None
    from minivllm.kernels.gemv_configs import lookup
    from minivllm.kernels.gpu_profile import gpu_profile

    profile = gpu_profile(x.device)
    return lookup(profile.table_key, w.ggml_type.name, w.shape[0], w.shape[1], profile.sm_count)


class RepackedQuantizedWeight(QuantizedWeight):
    """A `QuantizedWeight` whose blocks live only in repacked form on the device.

    `raw` is rebuilt from the planes on access (a temporary, e.g. for the GEMM path's
    dequantization), so the device holds one copy of the weight, about the file's size.
    """

    def __init__(self, repacked: RepackedWeight):  # noqa: D107 (no dataclass __init__: raw is derived)
        self.repacked = repacked
        self.ggml_type = repacked.ggml_type
        self.shape = repacked.shape
        self.name = repacked.name

    @property
    def raw(self) -> torch.Tensor:  # type: ignore[override]
        return unpack_raw(self.repacked)

    @property
    def nbytes(self) -> int:
        return self.repacked.nbytes

    @property
    def device(self) -> torch.device:
        return self.repacked.device

    def __repr__(self) -> str:
        return f"RepackedQuantizedWeight({self.name!r}, {self.type_name}, shape={self.shape}, nbytes={self.nbytes})"

    __eq__ = object.__eq__
    __hash__ = object.__hash__
