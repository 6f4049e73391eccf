"""The decode GEMV (M rows of activations, usually 1) over the repacked layout, tiled for
bandwidth: each program owns BLOCK_NB row groups (4 rows each) and one of SPLIT slices of
K, and the launch shape comes from a per-GPU table (`kernels/gemv_configs.py`).

Why not `repacked_gemv.py`'s one-row-group-per-program kernel: at M = 1 it moved weights
at 15-30% of the H200's copy bandwidth (benchmarks/results/h200-issue19-*). Each of its
programs reads 7 KB (a 3584-wide Q4_K row group) in two loop trips, so an SM has little
memory in flight, and every thread reloads the activations for every row group. Here

* a program reads a [BLOCK_NB, BLOCK_G, T, 4] int32 tile per trip (16-byte loads of 4
  rows' words), BLOCK_NB row groups sharing each activation a thread loads;
* narrow matrices (few rows, long K: the 7B's K/V and down projections) split K into
  SPLIT slices so every SM gets work; the slices' float32 partial sums go to a workspace
  and a second small kernel adds them in slice order, so the result does not depend on
  which program finished first (no atomics: batch-invariant mode stays bit-identical);
* activations are loaded `evict_last`, weights `evict_first` (each weight byte is used
  once per call, the activations by every program).

Each activation row is its own set of programs and the configuration depends on the
weight's type and shape only, so a row's result is bitwise independent of M and of the
other rows: this kernel also serves batch-invariant mode.

Arithmetic is `repacked_gemv.py`'s (quant_fields.py: no I2F, float32 only, no `tl.dot`),
so it compiles for sm_75.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.gemv_configs import GemvConfig
from minivllm.kernels.repacked_layout import PLANE_ORDER, R, RepackedWeight
from minivllm.kernels.triton.quant_fields import field, field_hi, i8_to_f32, u8_to_f32


@triton.jit(do_not_specialize=["M", "N", "N_RB", "G_PER_SPLIT"])
def _tiled_gemv_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_om, stride_os, G_PER_SPLIT, N_RB,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_G: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    nb = pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[:, None, None, None]  # [NB, 1, 1, 1]
    nb_ok = nb < N_RB
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, T)
    g4 = offs_g[None, :, None, None]
    t4 = offs_t[None, None, :, None]
    r4 = tl.arange(0, RR)[None, None, None, :]
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    g_lo = pid_s * G_PER_SPLIT
    g_hi = tl.minimum(g_lo + G_PER_SPLIT, N_GROUPS)
    acc = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
    for i in range(0, G_PER_SPLIT, BLOCK_G):
        gg = g_lo + i + g4
        ok = nb_ok & (gg < g_hi)
        gr = (nb * N_GROUPS + gg) * RR + r4 + t4 * 0  # per-(group, row) planes, in the tile's shape
        w = tl.load(q_ptr + ((nb * N_GROUPS + gg) * T + t4) * RR + r4, mask=ok, other=0,
                    eviction_policy="evict_first")  # 16-byte loads (ld.global.v4 in the sm_90 PTX)
        # x[g*32 + p*T + t]: one value per (g, t), shared by every row of the tile. Built
        # from [G, T] offsets (the weight tile's slice layout: no layout conversion).
        g2 = g_lo + i + offs_g[:, None]
        x_off = g2 * 32 + offs_t[None, :]
        x_ok = g2 < g_hi
        if KIND == 3:  # Q8_0: 4 bytes per word, stored as q + 128
            ps = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
            w_hi = w >> 16
            for p in tl.static_range(4):
                xp = tl.load(x_row + x_off + p * T, mask=x_ok, other=0.0, eviction_policy="evict_last")
                xp = xp.to(tl.float32)[None, :, :, None]
                if p < 2:
                    ps += field(w, p, 8, 128) * xp
                else:
                    ps += field(w_hi, p - 2, 8, 128) * xp
            d = tl.load(a_ptr + gr, mask=ok, other=0.0).to(tl.float32)
            acc += ps * d
        elif KIND == 5:  # Q6_K: nibble plane + 2-bit plane, two 16-element scales per group
            h = tl.load(b_ptr + ((nb * N_GROUPS + gg) * T + t4) * RR + r4, mask=ok, other=0,
                        eviction_policy="evict_first").to(tl.int32)
            h_lo = h << 4
            h_hi = h << 2
            w_hi = w >> 16
            ps_lo = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
            ps_hi = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
            for p in tl.static_range(8):
                xp = tl.load(x_row + x_off + p * T, mask=x_ok, other=0.0, eviction_policy="evict_last")
                xp = xp.to(tl.float32)[None, :, :, None]
                if p < 4:
                    ps_lo += field_hi(w, h_lo, p, 2, 32) * xp
                else:
                    ps_hi += field_hi(w_hi, h_hi, p - 4, 2, 32) * xp
            s_lo = i8_to_f32(tl.load(c_ptr + gr, mask=ok, other=0))
            s_hi = i8_to_f32(tl.load(e_ptr + gr, mask=ok, other=0))
            sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r4 + t4 * 0
            d = tl.load(a_ptr + sb, mask=ok, other=0.0).to(tl.float32)
            acc += (ps_lo * s_lo + ps_hi * s_hi) * d
        else:  # 4-bit codes: Q4_0, Q4_1, Q5_0, Q4_K
            w_hi = w >> 16
            if KIND == 2:  # Q5_0: the fifth bits of the group, element (p, t) at 16(p//4) + 4(p%4) + t
                h = tl.load(b_ptr + gr, mask=ok, other=0) >> t4
                h_lo = h << 4
                h_hi = h >> 12
            ps = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
            sx = tl.zeros([1, BLOCK_G, T, 1], dtype=tl.float32)
            for p in tl.static_range(8):
                xp = tl.load(x_row + x_off + p * T, mask=x_ok, other=0.0, eviction_policy="evict_last")
                xp = xp.to(tl.float32)[None, :, :, None]
                if KIND == 2:
                    if p < 4:
                        f = field_hi(w, h_lo, p, 1, 16)
                    else:
                        f = field_hi(w_hi, h_hi, p - 4, 1, 16)
                elif KIND == 0:
                    if p < 4:
                        f = field(w, p, 4, 8)
                    else:
                        f = field(w_hi, p - 4, 4, 8)
                else:
                    if p < 4:
                        f = field(w, p, 4, 0)
                    else:
                        f = field(w_hi, p - 4, 4, 0)
                    sx += xp
                ps += f * xp
            if KIND == 1:  # Q4_1: d * q + m
                d = tl.load(a_ptr + gr, mask=ok, other=0.0).to(tl.float32)
                m = tl.load(b_ptr + gr, mask=ok, other=0.0).to(tl.float32)
                acc += ps * d + m * sx
            elif KIND == 4:  # Q4_K: (d * sc) * q - (dmin * m)
                sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r4 + t4 * 0
                d = tl.load(a_ptr + sb, mask=ok, other=0.0).to(tl.float32)
                dmin = tl.load(b_ptr + sb, mask=ok, other=0.0).to(tl.float32)
                sc = u8_to_f32(tl.load(c_ptr + gr, mask=ok, other=0))
                mn = u8_to_f32(tl.load(e_ptr + gr, mask=ok, other=0))
                acc += ps * (d * sc) - (dmin * mn) * sx
            else:  # Q4_0, Q5_0: d * (q - offset), the offset already subtracted
                d = tl.load(a_ptr + gr, mask=ok, other=0.0).to(tl.float32)
                acc += ps * d
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [NB, R]
    nb2 = pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[:, None]
    rows = nb2 * RR + tl.arange(0, RR)[None, :]
    r_ok = rows < N
    if not IS_SPLIT:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=r_ok, other=0.0)
        tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=r_ok)
    else:  # a float32 partial: the workspace [SPLIT, M, N]
        tl.store(out_ptr + pid_s.to(tl.int64) * stride_os + pid_m.to(tl.int64) * stride_om + rows, y, mask=r_ok)


@triton.jit
def _sum_splits_kernel(ws_ptr, bias_ptr, out_ptr, MN, N, stride_ws, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum of the SPLIT partials, in slice order (+ bias), rounded once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    y = tl.load(ws_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        y += tl.load(ws_ptr + s * stride_ws + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs % N, mask=ok, other=0.0)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


_SUM_BLOCK = 1024


def launch_shape(n: int, k: int, m: int, config: GemvConfig) -> tuple[tuple[int, int, int], int, int]:
    """(grid, groups per slice, slices) of `config` for an (n, k) weight and m rows: the
    slices are whole loop trips, and none is empty."""
    n_groups = k // 32
    split = max(1, min(config.split, n_groups))
    g_per = triton.cdiv(triton.cdiv(n_groups, split), config.block_g) * config.block_g
    split = triton.cdiv(n_groups, g_per)
    return (triton.cdiv(triton.cdiv(n, R), config.block_nb), split, m), g_per, split


def sum_splits(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = the workspace's slices (split, m, n) summed in slice order (+ bias), rounded once."""
    split, m, n = ws.shape
    has_bias = bias is not None
    _sum_splits_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](ws, bias if has_bias else out, out, m * n, n, m * n,
                                                          SPLIT=split, HAS_BIAS=has_bias, BLOCK=_SUM_BLOCK, num_warps=4)


def tiled_gemv(x: torch.Tensor, w: RepackedWeight, config: GemvConfig, *, out_dtype: torch.dtype | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias), float32 accumulation, one rounding to `out_dtype` (default
    float32). x: (M, K) on w's device (the caller checks shapes and devices)."""
    n, k = w.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or torch.float32, device=x.device)
    if m == 0:
        return out
    grid, g_per, split = launch_shape(n, k, m, config)
    ptrs = [w.planes[nm] if nm is not None else w.qs for nm in PLANE_ORDER[w.ggml_type.name]]
    has_bias = bias is not None
    dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _tiled_gemv_kernel[grid](
        x, w.qs, *ptrs, bias if has_bias else out, dest, m, n, x.stride(0), n, m * n, g_per, triton.cdiv(n, R),
        N_GROUPS=k // 32, KIND=w.kind, T=w.words_per_group, RR=R, BLOCK_NB=config.block_nb,
        BLOCK_G=config.block_g, IS_SPLIT=split > 1, HAS_BIAS=has_bias,
        num_warps=config.num_warps, num_stages=config.num_stages)
    if split > 1:
        sum_splits(dest, out, bias)
    return out
