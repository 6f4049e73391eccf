"""The tiled GEMV for a few activation rows (2 to 8): each weight tile decoded once and
applied to every row.

Why: a batched decode step multiplies the same weights by one row per sequence. The tiled
kernel (`tiled_gemv.py`) runs each row as programs of its own, so M rows decode every
weight M times (and, until `tile_and_row`, read it from DRAM M times); the GPU path
therefore sent every step of more than one row to the dense GEMM over the dequantized f16
weights, 3.5x a Q4_K file's bytes. llama.cpp's mmvq takes up to 8 columns per weight load.
Here a program owns BLOCK_NB row groups, one K slice and BLOCK_M activation rows: per trip
it loads and decodes its [NB, G, T, R] word tile once (`repacked_decode`: the same fields,
scales and sums as the tiled kernel) and accumulates [M, NB, G, T, R] products, so the
weight's bytes and its decoding are paid once for the M rows, the multiply-adds M times.

Not batch-invariant: a row's sums follow this kernel's tile and trip order, not the
one-row kernel's. Batch-invariant mode keeps the tiled kernel a row at a time. Where it
runs: `repacked_gemv` for 2 <= M <= MAX_ROWS rows outside batch-invariant mode (a step takes
the GEMV path for at most `gemv_max_rows` rows: 1 by default on a GPU, so the engine's
default does not reach it until a measurement moves that default).

Arithmetic is float32 without `tl.dot` or bf16 (it compiles for sm_75). No PDL early trips,
no T-outer tile, no gate+up epilogue: those are the one-row kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.repacked_layout import PLANE_ORDER, R, RepackedWeight
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers
from minivllm.kernels.triton.repacked_decode import decode_field, group_scales, high_fields, scaled_sum, trip_bits

MAX_ROWS = 8  # rows a program carries; more go to further programs along grid axis 2
# One tile for every shape: 2 row groups x 16 groups a trip is 512 words, 4 a thread over 4
# warps: 16-byte weight loads (a smaller tile drops to 8-byte ones). With 8 rows the [8, NB,
# G, T, R] accumulators take Q4_K to 168 (sm_75) / 180 (sm_90) registers a thread and Q6_K,
# which keeps a second one for its upper scales, to 255, without spills (the compile test).
# Untimed: a sweep over tiles and row counts is the next step.
BLOCK_NB, BLOCK_G, NUM_WARPS = 2, 16, 4


@triton.jit(do_not_specialize=["M", "N", "N_RB", "G_PER_SPLIT", "ONES"])
def _multirow_gemv_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_om, stride_os, G_PER_SPLIT, N_RB, ONES,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, IS_SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """out[m, n] (or, IS_SPLIT, the float32 partial of this K slice into the workspace
    [SPLIT, M, N]) for rows m of block program_id(2), row groups of block program_id(0)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    nb = pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[:, None, None, None]  # [NB, 1, 1, 1]
    nb_ok = nb < N_RB
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, T)
    g4 = offs_g[None, :, None, None]
    t4 = offs_t[None, None, :, None]
    r4 = tl.arange(0, RR)[None, None, None, :]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None, None] * stride_xm  # [M, 1, 1]
    g_lo = pid_s * G_PER_SPLIT
    g_hi = tl.minimum(g_lo + G_PER_SPLIT, N_GROUPS)
    wait_for_producers(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
    for g0 in range(g_lo, g_hi, BLOCK_G):
        gg = g0 + g4
        ok = nb_ok & (gg < g_hi)
        w, h = trip_bits(q_ptr, b_ptr, nb, ok, gg, t4, r4, N_GROUPS, KIND, T, RR, True, True)
        w_hi = w >> 16
        h_lo = w  # unused by the types without a high-bit plane
        h_hi = w
        if KIND == 5:
            h_lo, h_hi = high_fields(h, KIND)
        elif KIND == 2:
            h_lo, h_hi = high_fields(h >> t4, KIND)
        g2 = g0 + offs_g[:, None]
        x_off = (g2 * 32 + offs_t[None, :])[None, :, :]  # [1, G, T]: x[g*32 + p*T + t]
        x_ok = m_ok[:, None, None] & (g2 < g_hi)[None, :, :]
        ps = tl.zeros([BLOCK_M, BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
        ps_hi = tl.zeros([BLOCK_M, BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
        sx = tl.zeros([BLOCK_M, 1, BLOCK_G, T, 1], dtype=tl.float32)
        for p in tl.static_range(32 // T):
            xp = tl.load(x_rows + x_off + p * T, mask=x_ok, other=0.0, eviction_policy="evict_last")
            xp = xp.to(tl.float32)[:, None, :, :, None]  # [M, 1, G, T, 1]
            f = decode_field(w, w_hi, h_lo, h_hi, p, KIND, ONES)[None, :, :, :, :]  # decoded once for the M rows
            if KIND == 5 and p >= 4:  # Q6_K: the group's second 16-element scale
                ps_hi += f * xp
            else:
                ps += f * xp
            if KIND == 1:
                sx += xp
            elif KIND == 4:
                sx += xp
        gr = (nb * N_GROUPS + gg) * RR + r4 + t4 * 0
        sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r4 + t4 * 0
        d, m, s_lo, s_hi = group_scales(a_ptr, b_ptr, c_ptr, e_ptr, gr, sb, ok, KIND, True)
        acc += scaled_sum(ps, ps_hi, sx, d[None, :, :, :, :], m[None, :, :, :, :], s_lo[None, :, :, :, :],
                          s_hi[None, :, :, :, :], KIND)
    y = tl.sum(tl.sum(acc, axis=3), axis=2)  # [M, NB, R]
    rows = ((pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB))[:, None] * RR + tl.arange(0, RR)[None, :])[None, :, :]
    ok_out = m_ok[:, None, None] & (rows < N)
    at = offs_m.to(tl.int64)[:, None, None] * stride_om + rows
    if IS_SPLIT:
        tl.store(out_ptr + pid_s.to(tl.int64) * stride_os + at, y, mask=ok_out)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0)
        tl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=ok_out)


def multirow_gemv(x: torch.Tensor, w: RepackedWeight, *, split: int = 1, out_dtype: torch.dtype | None = None,
                  bias: torch.Tensor | None = None, defer_split_sum: bool = False):
    """y = x @ W.T (+ bias) for x (M, K), float32 accumulation, rounded once to `out_dtype`
    (default float32); K cut into `split` slices (whole trips, none empty) summed in slice
    order (`split_sum.py`), or handed back unsummed with `defer_split_sum`."""
    from minivllm.kernels.triton.tiled_gemv import FIELD_ONES, gemv_inputs, split_output

    n, k = w.shape
    x, out_dtype, empty = gemv_inputs(x, n, out_dtype)
    if empty is not None:
        return empty
    m = x.shape[0]
    n_groups = k // 32
    g_per = triton.cdiv(triton.cdiv(n_groups, max(1, min(split, n_groups))), BLOCK_G) * BLOCK_G
    split = triton.cdiv(n_groups, g_per)
    block_m = min(triton.next_power_of_2(m), MAX_ROWS)
    grid = (triton.cdiv(triton.cdiv(n, R), BLOCK_NB), split, triton.cdiv(m, block_m))
    has_bias = bias is not None
    dest = (torch.empty((m, n), dtype=out_dtype, device=x.device) if split == 1
            else torch.empty((split, m, n), dtype=torch.float32, device=x.device))
    planes = [w.planes[nm] if nm is not None else w.qs for nm in PLANE_ORDER[w.ggml_type.name]]
    _multirow_gemv_kernel[grid](
        x, w.qs, *planes, bias if has_bias and split == 1 else dest, dest, m, n, x.stride(0), n, m * n, g_per,
        triton.cdiv(n, R), FIELD_ONES, N_GROUPS=n_groups, KIND=w.kind, T=w.words_per_group, RR=R,
        BLOCK_NB=BLOCK_NB, BLOCK_G=BLOCK_G, BLOCK_M=block_m, IS_SPLIT=split > 1, HAS_BIAS=has_bias and split == 1,
        num_warps=NUM_WARPS, **pdl_args(x.device))
    return dest if split == 1 else split_output(dest, out_dtype, bias, defer_split_sum=defer_split_sum)
