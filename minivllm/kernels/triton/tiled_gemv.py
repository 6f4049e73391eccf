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
  which program finished first (no atomics: batch-invariant mode stays bit-identical).
  The rule is `split_sum.py`'s; with `defer_split_sum` the caller gets the workspace
  (`SplitPartials`) and its consumer, add_rms_norm, sums it instead of that kernel;
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
from minivllm.kernels.triton.fused import silu_mul
from minivllm.kernels.triton.pdl import early_trips, pdl_args, wait_for_producers
from minivllm.kernels.triton.repacked_decode import (
    decode_field,
    group_scales,
    high_fields,
    load,
    scaled_sum,
    store_rows,
    tile_and_row,
    trip_bits,
)
from minivllm.kernels.triton.split_sum import (
    ROUND_CODES,
    SplitPartials,
    fixup_requested,
    last_slice_sums,
    round_to,
    slice_sum,
    split_tickets,
)


@triton.jit
def gemv_trip(acc, ONES, g0, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr,
          N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr, BLOCK_NB: tl.constexpr,
          BLOCK_G: tl.constexpr, MASKED: tl.constexpr, bits=None, EARLY: tl.constexpr = 0):
    """One trip of the K loop: groups g0 .. g0 + BLOCK_G of the tile's rows added to acc
    (MASKED: groups past g_hi or rows past the matrix read as zeros). EARLY: the trip's
    quantized bits are `bits` (`trip_bits`), loaded by the caller before its PDL wait."""
    gg = g0 + g4
    ok = nb_ok & (gg < g_hi)
    gr = (nb * N_GROUPS + gg) * RR + r4 + t4 * 0  # per-(group, row) planes, in the tile's shape
    if EARLY:
        w, h = bits
    else:
        w, h = trip_bits(q_ptr, b_ptr, nb, ok, gg, t4, r4, N_GROUPS, KIND, T, RR, MASKED, True)
    w_hi = w >> 16
    h_lo = w  # unused by the types without a high-bit plane
    h_hi = w
    if KIND == 5:  # Q6_K: 2-bit plane, word-shaped
        h_lo, h_hi = high_fields(h, KIND)
    elif KIND == 2:  # Q5_0: the fifth bits of the group, element (p, t) at 16(p//4) + 4(p%4) + t
        h_lo, h_hi = high_fields(h >> t4, KIND)
    # x[g*32 + p*T + t]: one value per (g, t), shared by every row of the tile. Built
    # from [G, T] offsets (the weight tile's slice layout: no layout conversion).
    g2 = g0 + offs_g[:, None]
    x_off = g2 * 32 + offs_t[None, :]
    x_ok = g2 < g_hi
    ps = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
    ps_hi = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
    sx = tl.zeros([1, BLOCK_G, T, 1], dtype=tl.float32)
    for p in tl.static_range(32 // T):
        xp = load(x_row + x_off + p * T, x_ok, 0.0, MASKED, 2)
        xp = xp.to(tl.float32)[None, :, :, None]
        f = decode_field(w, w_hi, h_lo, h_hi, p, KIND, ONES)
        if KIND == 5:  # two 16-element scales per group
            if p < 4:
                ps += f * xp
            else:
                ps_hi += f * xp
        else:
            ps += f * xp
        if KIND == 1:
            sx += xp
        elif KIND == 4:
            sx += xp
    sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r4 + t4 * 0  # per-(super-block, row) planes
    d, m, s_lo, s_hi = group_scales(a_ptr, b_ptr, c_ptr, e_ptr, gr, sb, ok, KIND, MASKED)
    return acc + scaled_sum(ps, ps_hi, sx, d, m, s_lo, s_hi, KIND)


@triton.jit
def gemv_trip_t_outer(acc, ONES, g0, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr, a_ptr, b_ptr, c_ptr,
                      e_ptr, N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
                      BLOCK_NB: tl.constexpr, BLOCK_G: tl.constexpr, MASKED: tl.constexpr, bits=None,
                      EARLY: tl.constexpr = 0):
    """`gemv_trip` over a [T, NB, G, R] tile (T_OUTER): Triton spreads lanes over the
    fastest axes first, so with T outermost one thread holds a group's T words for its 4
    rows, and the group's scales apply once to their T-summed field sums (acc: [NB, G, R])
    instead of once a word: 589 instructions a trip against 736 for Q4_K (sm_90 SASS,
    scripts/gemv_sass.py). Same weights and activations, another order of the sums."""
    gg = g0 + g4  # [1, 1, G, 1]
    ok = nb_ok & (gg < g_hi)  # [1, NB, G, 1]
    if EARLY:
        w, h = bits
    else:  # [T, NB, G, R] words
        w, h = trip_bits(q_ptr, b_ptr, nb, ok, gg, t4, r4, N_GROUPS, KIND, T, RR, MASKED, False)
    w_hi = w >> 16
    h_lo = w
    h_hi = w
    if KIND == 5:
        h_lo, h_hi = high_fields(h, KIND)
    elif KIND == 2:
        h_lo, h_hi = high_fields(h >> t4, KIND)
    g2 = g0 + offs_g[None, :]  # [1, G]
    x_off = g2 * 32 + offs_t[:, None]  # [T, G]: x[g*32 + p*T + t]
    x_ok = g2 < g_hi
    ps = tl.zeros([T, BLOCK_NB, BLOCK_G, RR], dtype=tl.float32)
    ps_hi = tl.zeros([T, BLOCK_NB, BLOCK_G, RR], dtype=tl.float32)
    xs = tl.zeros([T, BLOCK_G], dtype=tl.float32)
    for p in tl.static_range(32 // T):
        x2 = load(x_row + x_off + p * T, x_ok, 0.0, MASKED, 2).to(tl.float32)
        xs += x2
        xp = x2[:, None, :, None]
        f = decode_field(w, w_hi, h_lo, h_hi, p, KIND, ONES)
        if KIND == 5 and p >= 4:
            ps_hi += f * xp
        else:
            ps += f * xp
    nb3 = tl.reshape(nb, [BLOCK_NB, 1, 1])
    gg3 = tl.reshape(gg, [1, BLOCK_G, 1])
    r3 = tl.reshape(r4, [1, 1, RR])
    ok3 = tl.reshape(nb_ok, [BLOCK_NB, 1, 1]) & (gg3 < g_hi)
    gr = (nb3 * N_GROUPS + gg3) * RR + r3
    sb = (nb3 * (N_GROUPS // 8) + gg3 // 8) * RR + r3
    d, m, s_lo, s_hi = group_scales(a_ptr, b_ptr, c_ptr, e_ptr, gr, sb, ok3, KIND, MASKED)
    sx = tl.reshape(tl.sum(xs, axis=0), [1, BLOCK_G, 1])  # the group's activation sum (Q4_1, Q4_K mins)
    return acc + scaled_sum(tl.sum(ps, axis=0), tl.sum(ps_hi, axis=0), sx, d, m, s_lo, s_hi, KIND)


@triton.jit(do_not_specialize=["M", "N", "N_RB", "G_PER_SPLIT", "PAIR_RB", "ONES"])
def _tiled_gemv_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_om, stride_os, G_PER_SPLIT, N_RB, PAIR_RB, ONES,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_G: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    PAIRED: tl.constexpr, ROUND: tl.constexpr, PDL: tl.constexpr = False, EVEN_N: tl.constexpr = False,
    EARLY: tl.constexpr = 0, FIXUP: tl.constexpr = False, SPLIT: tl.constexpr = 1, ticket_ptr=None,
    final_ptr=None, T_OUTER: tl.constexpr = False,
):  # fmt: skip
    """PAIRED (a gate+up weight, the up rows PAIR_RB row groups after the gate rows; N,
    N_RB: the gate half's): the tile's row groups alternate gate, up (BLOCK_NB // 2 of
    each) and the epilogue writes silu(g) * u, g and u first rounded to the matmul dtype
    (ROUND: 16 = f16, 17 = bf16, 0 = none) as the separate GEMVs would have returned them.
    ONES: 15, passed at run time (quant_fields.py: keeps the field masks in registers).
    EVEN_N: every program's row groups are inside the matrix (N_RB a multiple of the
    program's row groups), so whole trips load without masks.
    EARLY (1 or 2, PDL only): the first EARLY trips' quantized bits (`trip_bits`: words
    and high-bit plane) are loaded before the wait (they depend on no earlier kernel;
    pdl.py `early_weights`), always masked; the same trips in the same order as without,
    so the same sums. The launch passes no more than a slice's trips (`pdl.early_trips`).
    FIXUP (split into SPLIT slices, not paired): the last program of each output tile sums
    the slices into final_ptr [M, N] itself (`split_sum.last_slice_sums`, tickets at
    ticket_ptr).
    T_OUTER (not paired): the tile's axes ordered [T, NB, G, R] (`gemv_trip_t_outer`)."""
    pid_n, pid_m = tile_and_row(M)
    pid_s = tl.program_id(1)
    if PAIRED:
        tile = tl.arange(0, BLOCK_NB)[:, None, None, None]
        nb_own = pid_n * (BLOCK_NB // 2) + tile // 2  # this gate/up pair's row group of the gate half
        nb_ok = nb_own < N_RB
        nb = nb_own + (tile % 2) * PAIR_RB
    elif T_OUTER:
        nb = pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[None, :, None, None]  # [1, NB, 1, 1]
        nb_ok = nb < N_RB
    else:
        nb = pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[:, None, None, None]  # [NB, 1, 1, 1]
        nb_ok = nb < N_RB
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, T)
    if T_OUTER:
        g4 = offs_g[None, None, :, None]
        t4 = offs_t[:, None, None, None]
    else:
        g4 = offs_g[None, :, None, None]
        t4 = offs_t[None, None, :, None]
    r4 = tl.arange(0, RR)[None, None, None, :]
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    g_lo = pid_s * G_PER_SPLIT
    g_hi = tl.minimum(g_lo + G_PER_SPLIT, N_GROUPS)
    if EARLY:  # the first trips' bits, before the wait: their DRAM latency overlaps the producer
        g_1st = g_lo + g4
        bits_1st = trip_bits(q_ptr, b_ptr, nb, nb_ok & (g_1st < g_hi), g_1st, t4, r4, N_GROUPS, KIND, T, RR, True,
                             not T_OUTER)
    if EARLY >= 2:
        g_2nd = g_lo + BLOCK_G + g4
        bits_2nd = trip_bits(q_ptr, b_ptr, nb, nb_ok & (g_2nd < g_hi), g_2nd, t4, r4, N_GROUPS, KIND, T, RR, True,
                             not T_OUTER)
    wait_for_producers(PDL)
    # Whole trips first, loaded without masks where the tile's rows are all inside the
    # matrix (EVEN_N), then the slice's last partial trip, if any, masked. Same trips in
    # the same order as one masked loop: the same sums, fewer instructions a weight.
    # EARLY: the first EARLY trips are the ones loaded before the wait, masked.
    n_full = (g_hi - g_lo) // BLOCK_G * BLOCK_G
    done = tl.maximum(n_full, EARLY * BLOCK_G)  # groups the loop and the early trip cover
    if T_OUTER:
        acc3 = tl.zeros([BLOCK_NB, BLOCK_G, RR], dtype=tl.float32)
        if EARLY:
            acc3 = gemv_trip_t_outer(acc3, ONES, g_lo, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr,
                                     a_ptr, b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, True,
                                     bits_1st, EARLY)
        if EARLY >= 2:
            acc3 = gemv_trip_t_outer(acc3, ONES, g_lo + BLOCK_G, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row,
                                     q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, True,
                                     bits_2nd, EARLY)
        for i in range(EARLY * BLOCK_G, n_full, BLOCK_G):
            acc3 = gemv_trip_t_outer(acc3, ONES, g_lo + i, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr,
                                     a_ptr, b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, not EVEN_N)
        if done < g_hi - g_lo:
            acc3 = gemv_trip_t_outer(acc3, ONES, g_lo + done, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row,
                                     q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, True)
        y = tl.sum(acc3, axis=1)  # [NB, R]
    else:
        acc = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
        if EARLY:
            acc = gemv_trip(acc, ONES, g_lo, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr, a_ptr, b_ptr,
                            c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, True, bits_1st, EARLY)
        if EARLY >= 2:
            acc = gemv_trip(acc, ONES, g_lo + BLOCK_G, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr,
                            a_ptr, b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, True, bits_2nd,
                            EARLY)
        for i in range(EARLY * BLOCK_G, n_full, BLOCK_G):
            acc = gemv_trip(acc, ONES, g_lo + i, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr, a_ptr,
                            b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, not EVEN_N)
        if done < g_hi - g_lo:
            acc = gemv_trip(acc, ONES, g_lo + done, g_hi, nb, nb_ok, g4, t4, r4, offs_g, offs_t, x_row, q_ptr, a_ptr,
                            b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G, True)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [NB, R]
    if PAIRED:
        _store_swiglu(y, bias_ptr, out_ptr, pid_n, pid_s, pid_m, N, stride_om, stride_os, RR, BLOCK_NB, IS_SPLIT,
                      HAS_BIAS, ROUND)
    else:
        store_rows(y, bias_ptr, out_ptr, pid_n, pid_s, pid_m, N, stride_om, stride_os, RR, BLOCK_NB, IS_SPLIT, HAS_BIAS)
        if FIXUP:
            rows = (pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[:, None]) * RR + tl.arange(0, RR)[None, :]
            last_slice_sums(ticket_ptr + pid_m * (tl.num_programs(0) // M) + pid_n, out_ptr,
                            pid_m.to(tl.int64) * stride_om + rows, rows < N, stride_os, bias_ptr, rows, final_ptr,
                            pid_m.to(tl.int64) * N + rows, SPLIT, HAS_BIAS)


@triton.jit
def _store_swiglu(y, bias_ptr, out_ptr, pid_n, pid_s, pid_m, N, stride_om, stride_os, RR: tl.constexpr,
                  BLOCK_NB: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr):
    """The paired tile's [NB, R] sums (rows alternating gate, up by row group) as
    silu(g) * u into out[M, N], or, split, both halves' partials into the workspace
    [SPLIT, M, 2N] (gate at column n, up at N + n) for `_sum_splits_kernel`."""
    g, u = tl.split(tl.permute(tl.reshape(y, [BLOCK_NB // 2, 2, RR]), (0, 2, 1)))  # [NB/2, R] each
    nb2 = pid_n * (BLOCK_NB // 2) + tl.arange(0, BLOCK_NB // 2)[:, None]
    rows = nb2 * RR + tl.arange(0, RR)[None, :]
    r_ok = rows < N
    if IS_SPLIT:
        ws = out_ptr + pid_s.to(tl.int64) * stride_os + pid_m.to(tl.int64) * (2 * N) + rows
        tl.store(ws, g, mask=r_ok)
        tl.store(ws + N, u, mask=r_ok)
    else:
        if HAS_BIAS:
            g += tl.load(bias_ptr + rows, mask=r_ok, other=0.0)
            u += tl.load(bias_ptr + N + rows, mask=r_ok, other=0.0)
        y = silu_mul(round_to(g, ROUND), round_to(u, ROUND))
        tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=r_ok)


@triton.jit
def _sum_splits_kernel(ws_ptr, bias_ptr, out_ptr, MN, N, stride_ws, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PAIRED: tl.constexpr, ROUND: tl.constexpr,
                       PDL: tl.constexpr = False):
    """out = the SPLIT partials summed by `split_sum.slice_sum` (slice order, then bias),
    rounded once. PAIRED: the workspace rows hold gate (columns < N) and up (columns
    N..2N) partials; out [M, N] gets silu(g) * u of the two sums (each rounded as its
    GEMV's output would be)."""
    wait_for_producers(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    if PAIRED:
        col = offs % N
        at = (offs // N) * (2 * N) + col
        g = slice_sum(ws_ptr, at, ok, stride_ws, bias_ptr, col, SPLIT, HAS_BIAS)
        u = slice_sum(ws_ptr, at + N, ok, stride_ws, bias_ptr, N + col, SPLIT, HAS_BIAS)
        y = silu_mul(round_to(g, ROUND), round_to(u, ROUND))
    else:
        y = slice_sum(ws_ptr, offs, ok, stride_ws, bias_ptr, offs % N, SPLIT, HAS_BIAS)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


_SUM_BLOCK = 1024
FIELD_ONES = 15  # the kernel's ONES argument (quant_fields.py)


def launch_shape(n: int, k: int, m: int, config: GemvConfig) -> tuple[tuple[int, int, int], int, int]:
    """(grid, groups per slice, slices) of `config` for an (n, k) weight and m rows: the
    slices are whole loop trips, and none is empty."""
    n_groups = k // 32
    split = max(1, min(config.split, n_groups))
    g_per = triton.cdiv(triton.cdiv(n_groups, split), config.block_g) * config.block_g
    split = triton.cdiv(n_groups, g_per)
    return (triton.cdiv(triton.cdiv(n, R), config.block_nb) * m, split, 1), g_per, split  # tile_and_row


def sum_splits(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, *, paired: bool = False,
               mid_dtype: torch.dtype = torch.float32) -> None:
    """out = the workspace's slices (split, m, n) summed in slice order (+ bias), rounded
    once; `paired`: ws (split, m, 2n) of gate and up partials, out = silu(g) * u."""
    split, m, n = ws.shape
    n = n // 2 if paired else n
    has_bias = bias is not None
    _sum_splits_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](ws, bias if has_bias else out, out, m * n, n, ws.stride(0),
                                                          SPLIT=split, HAS_BIAS=has_bias, BLOCK=_SUM_BLOCK,
                                                          PAIRED=paired, ROUND=ROUND_CODES[mid_dtype], num_warps=4,
                                                          **pdl_args(out.device))


def _planes(w: RepackedWeight) -> list[torch.Tensor]:
    return [w.planes[nm] if nm is not None else w.qs for nm in PLANE_ORDER[w.ggml_type.name]]


def split_output(ws: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None, *,
                 defer_split_sum: bool) -> torch.Tensor | SplitPartials:
    """A split GEMV's result from its workspace: the partials as they are
    (`defer_split_sum`, for a consumer that sums them itself), else the summed output."""
    if defer_split_sum:
        return SplitPartials(ws, bias, out_dtype)
    out = torch.empty(ws.shape[1:], dtype=out_dtype, device=ws.device)
    sum_splits(ws, out, bias)
    return out


def gemv_inputs(x: torch.Tensor, n: int, out_dtype: torch.dtype | None):
    """(x with unit stride along K, the output dtype (default float32), the (0, n) result
    when x has no rows, else None): what every decode GEMV launcher starts with."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out_dtype = out_dtype or torch.float32
    return x, out_dtype, (torch.empty((0, n), dtype=out_dtype, device=x.device) if x.shape[0] == 0 else None)


def tiled_gemv(x: torch.Tensor, w: RepackedWeight, config: GemvConfig, *, out_dtype: torch.dtype | None = None,
               bias: torch.Tensor | None = None, defer_split_sum: bool = False) -> torch.Tensor | SplitPartials:
    """y = x @ W.T (+ bias), float32 accumulation, one rounding to `out_dtype` (default
    float32). x: (M, K) on w's device (the caller checks shapes and devices).
    `defer_split_sum`: where `config` splits K, return the unsummed `SplitPartials`
    instead (one launch fewer; the consumer sums them, `split_sum.py`)."""
    n, k = w.shape
    x, out_dtype, empty = gemv_inputs(x, n, out_dtype)
    if empty is not None:
        return empty
    m = x.shape[0]
    grid, g_per, split = launch_shape(n, k, m, config)
    has_bias = bias is not None
    dest = (torch.empty((m, n), dtype=out_dtype, device=x.device) if split == 1
            else torch.empty((split, m, n), dtype=torch.float32, device=x.device))
    # Split and summed here: in this launch where asked (split_sum.py), else by a second one.
    fixup = {}
    if split > 1 and not defer_split_sum and fixup_requested():
        fixup = {"FIXUP": True, "SPLIT": split, "ticket_ptr": split_tickets(x.device, grid[0]),
                 "final_ptr": torch.empty((m, n), dtype=out_dtype, device=x.device)}
    _tiled_gemv_kernel[grid](
        x, w.qs, *_planes(w), bias if has_bias else dest, dest, m, n, x.stride(0), n, m * n, g_per,
        triton.cdiv(n, R), 0, FIELD_ONES, N_GROUPS=k // 32, KIND=w.kind, T=w.words_per_group, RR=R,
        BLOCK_NB=config.block_nb, BLOCK_G=config.block_g, IS_SPLIT=split > 1, HAS_BIAS=has_bias, PAIRED=False, ROUND=0,
        EVEN_N=triton.cdiv(n, R) % config.block_nb == 0, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_args(x.device), EARLY=early_trips(x.device, triton.cdiv(g_per, config.block_g)), **fixup,
        T_OUTER=config.t_outer)
    if fixup:
        return fixup["final_ptr"]
    return dest if split == 1 else split_output(dest, out_dtype, bias, defer_split_sum=defer_split_sum)


def tiled_gemv_swiglu(x: torch.Tensor, w: RepackedWeight, config: GemvConfig, *, mid_dtype: torch.dtype,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u for [g | u] = x @ W.T (+ bias), W the gate rows then the up rows (a
    fused gate+up weight, each half a multiple of 4 rows), in one launch (two when split):
    g and u rounded to `mid_dtype` first, then the product in float32 rounded once to
    `out_dtype`, the same bits as `swiglu(gate(x), up(x))` with the same launch shape.
    `config` is the fused weight's; its row groups per program are rounded up to an even
    number (half gate, half up)."""
    n2, k = w.shape
    half = n2 // 2
    if half % R or n2 % 2:
        raise ValueError(f"tiled_gemv_swiglu: {w.name!r} must be two halves of a multiple of {R} rows, got {n2}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, half), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    block_nb = max(2, config.block_nb + config.block_nb % 2)
    grid, g_per, split = launch_shape(n2, k, m, GemvConfig(block_nb, config.block_g, config.split))
    has_bias = bias is not None
    dest = out if split == 1 else torch.empty((split, m, n2), dtype=torch.float32, device=x.device)
    _tiled_gemv_kernel[grid](
        x, w.qs, *_planes(w), bias if has_bias else out, dest, m, half, x.stride(0), half, m * n2, g_per, half // R,
        half // R, FIELD_ONES, N_GROUPS=k // 32, KIND=w.kind, T=w.words_per_group, RR=R, BLOCK_NB=block_nb,
        BLOCK_G=config.block_g, IS_SPLIT=split > 1, HAS_BIAS=has_bias, PAIRED=True, ROUND=ROUND_CODES[mid_dtype],
        EVEN_N=(half // R) % (block_nb // 2) == 0, num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_args(x.device), EARLY=early_trips(x.device, triton.cdiv(g_per, config.block_g)))
    if split > 1:
        sum_splits(dest, out, bias, paired=True, mid_dtype=mid_dtype)
    return out
