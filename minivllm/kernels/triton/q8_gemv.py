"""GEMV with int8 activations and `dp4a` over the repacked layout (the T4 path; elsewhere
opt-in: MINIVLLM_Q8_GEMV=1, chosen in `kernels/gpu_profile.py`).

Why: the float32 repacked GEMV (`repacked_gemv.py`) is bound by instruction issue on the
H200 (~5 instructions per weight; 20-30% of copy bandwidth, docs/gpu-decode-vs-llama-cpp.md).
llama.cpp's mmvq quantizes the activations once per matmul to int8 groups of 32 and
multiplies 4 weight bytes by 4 activation bytes per `dp4a` (sm_61+, so a T4 too).

Activations (`quantize_q8`): per row and group of 32, dx = max|x| / 127 and
xq = round(x / dx) in -127..127, packed so that word j of a group holds elements
j, 8 + j, 16 + j, 24 + j in its bytes 0..3. That is the order the repacked weights
already have: word t of a 4-bit group holds element p * 4 + t in nibble p, so
`w & 0x0F0F0F0F` is elements t, 8+t, 16+t, 24+t (activation word t) and
`(w >> 4) & 0x0F0F0F0F` elements 4+t, ..., 28+t (activation word 4 + t); a Q8_0 word t
holds element p * 8 + t in byte p (activation word t). Integer sums are exact, so the
result equals dequant(W) @ (xq * dx) up to float32 rounding of the per-group terms: the
tests hold it to that reference with the float32 bound.

Off unless MINIVLLM_Q8_GEMV=1, on every GPU: it changes the numerics (activations rounded
to 8 bits per group, as llama.cpp does), so it runs only under its own name
(benchmarks/results/h100-issue41-vs-llama-cpp.md has its H100 rows).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from minivllm.kernels.gemv_configs import GemvConfig, default_config
from minivllm.kernels.gpu_profile import triton_interpreting
from minivllm.kernels.repacked_layout import PLANE_ORDER, R, RepackedWeight
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers
from minivllm.kernels.triton.repacked_decode import store_rows, tile_and_row, word_tile
from minivllm.kernels.triton.split_sum import SplitPartials

_T = GGMLQuantizationType
Q8_TYPES = frozenset({_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q8_0, _T.Q4_K, _T.Q6_K})


# --- activations -----------------------------------------------------------------------


@triton.jit
def _quantize_q8_kernel(x_ptr, xw_ptr, dx_ptr, stride_xm, N_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
                        PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)[:, None, None]
    b = tl.arange(0, 4)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    ok = g < N_GROUPS
    x = tl.load(x_ptr + row * stride_xm + g * 32 + b * 8 + j, mask=ok, other=0.0).to(tl.float32)  # element 8b + j
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)  # [G]
    dx = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    v = x * inv[:, None, None]
    v = (v + 12582912.0) - 12582912.0  # round to nearest even (|v| <= 127 << 2^22)
    q = tl.minimum(tl.maximum(v, -127.0), 127.0).to(tl.int32)
    word = tl.sum((q & 255) << (b * 8), axis=1)  # disjoint bytes: the sum is the OR
    gj = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)[:, None]
    tl.store(xw_ptr + row * (N_GROUPS * 8) + gj * 8 + tl.arange(0, 8)[None, :], word, mask=gj < N_GROUPS)
    g1 = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    tl.store(dx_ptr + row * N_GROUPS + g1, dx, mask=g1 < N_GROUPS)


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (int32 words (M, K/32, 8), float32 scales (M, K/32))."""
    m, k = x.shape
    if k % 32 or x.stride(-1) != 1:
        raise ValueError("quantize_q8: K must be a multiple of 32 and rows contiguous")
    groups = k // 32
    xw = torch.empty((m, groups, 8), dtype=torch.int32, device=x.device)
    dx = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    block = 32
    if m:
        _quantize_q8_kernel[(m, triton.cdiv(groups, block))](x, xw, dx, x.stride(0), N_GROUPS=groups, BLOCK_G=block,
                                                             **pdl_args(x.device))
    return xw, dx


# A layer's Q/K/V (and gate/up) read the same x: inside `sharing_quantization(x)`
# (kernels/linear.py's project_many) the first int8 GEMV quantizes x and the others reuse
# it (also inside a CUDA graph capture). Scoped, not cached by identity: a buffer reused
# with new contents (persistent inputs, in-place kernels) can never hit a stale entry,
# and inference tensors, which keep no version counter, need none.
_SCOPE: list = [None, None]  # [x whose quantization may be shared, its (xw, dx) once made]


@contextmanager
def sharing_quantization(x: torch.Tensor):
    saved = _SCOPE[:]
    _SCOPE[:] = [x, None]
    try:
        yield
    finally:
        _SCOPE[:] = saved


def quantize_shared(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_q8(x)`, made once per `sharing_quantization(x)` scope."""
    if _SCOPE[0] is x:
        if _SCOPE[1] is None:
            _SCOPE[1] = quantize_q8(x.contiguous())
        return _SCOPE[1]
    return quantize_q8(x.contiguous())


def unpack_q8(xw: torch.Tensor) -> torch.Tensor:
    """The int8 values (M, K) in element order, from `quantize_q8`'s words (for tests)."""
    m, groups, _ = xw.shape
    w = xw.to(torch.int64) & 0xFFFFFFFF
    by = torch.stack([((w >> (8 * b)) & 255) for b in range(4)], dim=2)  # (M, G, b, j): element 8b + j
    by = torch.where(by >= 128, by - 256, by)
    return by.reshape(m, groups * 32).to(torch.int8)


# --- the GEMV ---------------------------------------------------------------------------


@triton.jit
def _dp4a(a, b, c, EMULATE: tl.constexpr):
    """c + the dot product of the 4 signed bytes of a and b (PTX dp4a.s32.s32)."""
    if EMULATE:
        acc = c
        for k in tl.static_range(4):
            acc += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
        return acc
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _small_int_to_f32(v):
    """|v| < 2^22 as float32 without I2F."""
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit(do_not_specialize=["M", "N", "N_RB", "G_PER_SPLIT"])
def _q8_gemv_kernel(
    xw_ptr, dx_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_om, stride_os, G_PER_SPLIT, N_RB,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_G: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    EMULATE: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Tiled like `tiled_gemv.py` (BLOCK_NB row groups x one K slice per program, float32
    partials reduced in slice order when IS_SPLIT), with integer dot products per word."""
    wait_for_producers(PDL)
    pid_n, pid_m = tile_and_row(M)
    pid_s = tl.program_id(1)
    nb = pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[:, None, None, None]
    nb_ok = nb < N_RB
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, T)
    g4 = offs_g[None, :, None, None]
    t4 = offs_t[None, None, :, None]
    r4 = tl.arange(0, RR)[None, None, None, :]
    ones = tl.full([1, BLOCK_G, T, 1], 0x01010101, tl.int32)
    zero = tl.zeros([1, BLOCK_G, T, 1], tl.int32)
    xw_row = xw_ptr + pid_m.to(tl.int64) * (N_GROUPS * 8)
    dx_row = dx_ptr + pid_m.to(tl.int64) * N_GROUPS
    g_lo = pid_s * G_PER_SPLIT
    g_hi = tl.minimum(g_lo + G_PER_SPLIT, N_GROUPS)
    acc = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
    for i in range(0, G_PER_SPLIT, BLOCK_G):
        gg = g_lo + i + g4
        w, ok, gr = word_tile(q_ptr, nb, nb_ok, gg, g_hi, t4, r4, N_GROUPS, T, RR)
        # Activation words and scales per (g, t), from [G, T] offsets (the tile's slice layout).
        g2 = g_lo + i + offs_g[:, None]
        x_ok = g2 < g_hi
        dx = tl.load(dx_row + g2 + offs_t[None, :] * 0, mask=x_ok, other=0.0)[None, :, :, None]
        xa = tl.load(xw_row + g2 * 8 + offs_t[None, :], mask=x_ok, other=0, eviction_policy="evict_last")[
            None, :, :, None
        ]
        if KIND == 3:  # Q8_0: bytes q + 128 -> signed q (XOR 0x80808080, written as an int32)
            isum = _dp4a(w ^ -0x7F7F7F80, xa, zero, EMULATE)
            d = tl.load(a_ptr + gr, mask=ok, other=0.0).to(tl.float32)
            acc += _small_int_to_f32(isum) * (d * dx)
        else:
            xb = tl.load(xw_row + g2 * 8 + 4 + offs_t[None, :], mask=x_ok, other=0,
                         eviction_policy="evict_last")[None, :, :, None]  # activation word 4 + t
            lo = w & 0x0F0F0F0F  # fields 0, 2, 4, 6: elements t, 8+t, 16+t, 24+t (activation word t)
            hi = (w >> 4) & 0x0F0F0F0F  # fields 1, 3, 5, 7 (activation word 4 + t)
            if KIND == 5:  # Q6_K: two high bits per element (int16 plane), scales per 16 elements
                h = tl.load(b_ptr + ((nb * N_GROUPS + gg) * T + t4) * RR + r4, mask=ok, other=0,
                            eviction_policy="evict_first").to(tl.int32)
                # Element (p, t)'s bits sit at 4(p % 4) + 2(p // 4) of h; move them to bits
                # 4-5 of byte p // 2 of its word (`lo` for even p, `hi` for odd p).
                lo = lo | ((h << 4) & 0x00003030) | ((h << 18) & 0x30300000)
                hi = hi | (h & 0x00003030) | ((h << 14) & 0x30300000)
                # Bytes 0-1 of every word are elements 0-15 (scale sc_lo), bytes 2-3 16-31 (sc_hi).
                xa_lo = xa & 0xFFFF
                xb_lo = xb & 0xFFFF
                xa_hi = xa & -65536
                xb_hi = xb & -65536
                dot_lo = _dp4a(hi, xb_lo, _dp4a(lo, xa_lo, zero, EMULATE), EMULATE)
                dot_hi = _dp4a(hi, xb_hi, _dp4a(lo, xa_hi, zero, EMULATE), EMULATE)
                sum_lo = _dp4a(ones, xb_lo, _dp4a(ones, xa_lo, zero, EMULATE), EMULATE)
                sum_hi = _dp4a(ones, xb_hi, _dp4a(ones, xa_hi, zero, EMULATE), EMULATE)
                s_lo = _small_int_to_f32(tl.load(c_ptr + gr, mask=ok, other=0).to(tl.int32))  # int8 scales, no I2F
                s_hi = _small_int_to_f32(tl.load(e_ptr + gr, mask=ok, other=0).to(tl.int32))
                sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r4 + t4 * 0
                d = tl.load(a_ptr + sb, mask=ok, other=0.0).to(tl.float32)
                acc += (_small_int_to_f32(dot_lo - 32 * sum_lo) * s_lo
                        + _small_int_to_f32(dot_hi - 32 * sum_hi) * s_hi) * (d * dx)
            else:
                if KIND == 2:  # Q5_0: element (p, t)'s fifth bit at 16(p // 4) + 4(p % 4) + t
                    ht = tl.load(b_ptr + gr, mask=ok, other=0) >> t4
                    lo = lo | ((ht & 0x01010101) << 4)
                    hi = hi | (((ht >> 4) & 0x01010101) << 4)
                isum = _dp4a(hi, xb, _dp4a(lo, xa, zero, EMULATE), EMULATE)
                xs = _dp4a(ones, xb, _dp4a(ones, xa, zero, EMULATE), EMULATE)  # the word pair's 8 activations
                if KIND == 0:  # Q4_0: d * (q - 8)
                    d = tl.load(a_ptr + gr, mask=ok, other=0.0).to(tl.float32)
                    acc += _small_int_to_f32(isum - 8 * xs) * (d * dx)
                elif KIND == 2:  # Q5_0: d * (q - 16)
                    d = tl.load(a_ptr + gr, mask=ok, other=0.0).to(tl.float32)
                    acc += _small_int_to_f32(isum - 16 * xs) * (d * dx)
                elif KIND == 1:  # Q4_1: d * q + m
                    d = tl.load(a_ptr + gr, mask=ok, other=0.0).to(tl.float32)
                    mm = tl.load(b_ptr + gr, mask=ok, other=0.0).to(tl.float32)
                    acc += (_small_int_to_f32(isum) * d + _small_int_to_f32(xs) * mm) * dx
                else:  # Q4_K: (d * sc) * q - (dmin * m)
                    sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r4 + t4 * 0
                    d = tl.load(a_ptr + sb, mask=ok, other=0.0).to(tl.float32)
                    dmin = tl.load(b_ptr + sb, mask=ok, other=0.0).to(tl.float32)
                    sc = tl.load(c_ptr + gr, mask=ok, other=0).to(tl.int32)
                    mn = tl.load(e_ptr + gr, mask=ok, other=0).to(tl.int32)
                    acc += (_small_int_to_f32(isum) * (d * _small_int_to_f32(sc))
                            - _small_int_to_f32(xs) * (dmin * _small_int_to_f32(mn))) * dx
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [NB, R]
    # split: float32 partials, summed in order by split_sum.slice_sum (tiled_gemv.split_output)
    store_rows(y, bias_ptr, out_ptr, pid_n, pid_s, pid_m, N, stride_om, stride_os, RR, BLOCK_NB, IS_SPLIT, HAS_BIAS)


_KIND = {_T.Q4_0: 0, _T.Q4_1: 1, _T.Q5_0: 2, _T.Q8_0: 3, _T.Q4_K: 4, _T.Q6_K: 5}


def q8_gemv(x: torch.Tensor, w: RepackedWeight, config: GemvConfig | None = None, *,
            out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
            xq: tuple[torch.Tensor, torch.Tensor] | None = None,
            defer_split_sum: bool = False) -> torch.Tensor | SplitPartials:
    """y = (xq * dx) @ W.T (+ bias): x quantized per group of 32 to int8 (`quantize_q8`, or
    `xq` given), integer dot products, float32 per-group scaling, one rounding to out_dtype.
    The launch shape (`config`, default `default_config`) depends on the weight only, and
    each activation row has its own programs: rows are independent of the batch.
    `defer_split_sum`: as `tiled_gemv`'s (the unsummed `SplitPartials` where K is split)."""
    from minivllm.kernels.triton.tiled_gemv import launch_shape, split_output

    n, k = w.shape
    if w.ggml_type not in Q8_TYPES:
        raise ValueError(f"q8_gemv: {w.ggml_type.name} has no int8-activation kernel")
    xw, dx = xq if xq is not None else quantize_shared(x)
    m = xw.shape[0]
    out_dtype = out_dtype or torch.float32
    if m == 0:
        return torch.empty((0, n), dtype=out_dtype, device=xw.device)
    config = config or default_config(n, k)
    grid, g_per, split = launch_shape(n, k, m, config)
    ptrs = [w.planes[p] if p is not None else w.qs for p in PLANE_ORDER[w.ggml_type.name]]
    has_bias = bias is not None
    dest = (torch.empty((m, n), dtype=out_dtype, device=xw.device) if split == 1
            else torch.empty((split, m, n), dtype=torch.float32, device=xw.device))
    _q8_gemv_kernel[grid](
        xw, dx, w.qs, *ptrs, bias if has_bias else dest, dest, m, n, n, m * n, g_per, triton.cdiv(n, R),
        N_GROUPS=k // 32, KIND=_KIND[w.ggml_type], T=w.words_per_group, RR=R,
        BLOCK_NB=config.block_nb, BLOCK_G=config.block_g, IS_SPLIT=split > 1, HAS_BIAS=has_bias,
        EMULATE=triton_interpreting(), num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_args(xw.device))
    return dest if split == 1 else split_output(dest, out_dtype, bias, defer_split_sum=defer_split_sum)
