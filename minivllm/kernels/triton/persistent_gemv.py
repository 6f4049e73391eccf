"""A persistent decode GEMV over the repacked layout (a candidate the GEMV sweep times;
the engine runs it only under MINIVLLM_GEMV_KERNEL=persistent).

Why another launch of the same arithmetic: at the 7B's small matrices the tiled kernel
(tiled_gemv.py) moves weights at 35-45% of copy bandwidth (Q4_K 3584 x 3584, 7.4 MB: 7.2
µs; h100-s51-run1-gemv-sweep-sm90). Its ~200 programs each load one or two 32 KB trips
and end, so after the first wave an SM has little in flight, the last wave runs on a few
SMs, and a second launch adds the K slices. Here a fixed number of programs (a few per
SM) each walk their row-group tiles, every tile over the whole of K, with the trips of
all their tiles in ONE software-pipelined loop: the next tile's first weights are in
flight while this tile's last ones are summed, every SM streams its share from the
first cycle to the last, and there is no K split to add up.

Arithmetic: tiled_gemv's `gemv_trip` over each tile's K in order, then the same two
sums over the tile; BLOCK_G divides the groups, so no trip is partial. Under the
interpreter its bits are the tiled kernel's at split 1 with the same tile (tested); on a
GPU the warps' layout may order the tile's final sums otherwise. A row's bits depend on
the tile and the warps only (not on the program count, nor on M: each activation row
has its own programs), so a fixed launch serves batch-invariant mode.

Measured (h100-s52-lean-gemv-sweep-sm90, H100): correct at every 7B shape and type, and
SLOWER than the tiled kernel everywhere, e.g. Q4_K 3584 x 3584 12.5 µs against 7.3, the
FFN down matrix 53.2 against 20.7. One program walking many tiles serially leaves too few
loads in flight per SM; the tiled kernel's many short programs keep more. It stays an
opt-in candidate for the sweep, not a default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.repacked_layout import PLANE_ORDER, R, RepackedWeight
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers
from minivllm.kernels.triton.repacked_decode import store_rows
from minivllm.kernels.triton.tiled_gemv import FIELD_ONES, gemv_inputs, gemv_trip


@triton.jit(do_not_specialize=["M", "N", "N_RB", "N_TILES", "ONES"])
def _persistent_gemv_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_om, N_RB, N_TILES, ONES,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_NB: tl.constexpr, BLOCK_G: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program p of P takes tiles p, p + P, ... (BLOCK_NB row groups each), each over all
    N_GROUPS groups in BLOCK_G trips, one flattened loop. EVEN_N: every tile is inside the
    matrix, so the loads need no masks."""
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    programs = tl.num_programs(0)
    TRIPS: tl.constexpr = N_GROUPS // BLOCK_G
    my_tiles = (N_TILES - pid + programs - 1) // programs
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, T)
    g4 = offs_g[None, :, None, None]
    t4 = offs_t[None, None, :, None]
    r4 = tl.arange(0, RR)[None, None, None, :]
    rows_of_tile = tl.arange(0, BLOCK_NB)[:, None, None, None]
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    wait_for_producers(PDL)
    acc = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)
    for it in tl.range(0, my_tiles * TRIPS, num_stages=NUM_STAGES):
        tile = pid + (it // TRIPS) * programs
        nb = tile * BLOCK_NB + rows_of_tile
        acc = gemv_trip(acc, ONES, (it % TRIPS) * BLOCK_G, N_GROUPS, nb, nb < N_RB, g4, t4, r4, offs_g, offs_t,
                        x_row, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, N_GROUPS, KIND, T, RR, BLOCK_NB, BLOCK_G,
                        not EVEN_N)
        if it % TRIPS == TRIPS - 1:  # the tile's last trip: its rows are done
            y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [NB, R], as the tiled kernel sums a tile
            store_rows(y, bias_ptr, out_ptr, tile, 0, pid_m, N, stride_om, 0, RR, BLOCK_NB, False, HAS_BIAS)
            acc = tl.zeros([BLOCK_NB, BLOCK_G, T, RR], dtype=tl.float32)


def default_block_g(k: int) -> int:
    """The largest power of two up to 32 that divides the row's groups of 32 weights (so
    no trip is partial): 16 for K = 3584 (112 groups), 8 for 4864 (152), 4 for 896 (28)."""
    groups = k // 32
    g = 32
    while groups % g:
        g //= 2
    return g


def persistent_gemv(x: torch.Tensor, w: RepackedWeight, *, block_nb: int = 2, block_g: int | None = None,
                    programs_per_sm: int = 2, num_warps: int = 4, num_stages: int = 3,
                    out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
                    sm_count: int | None = None) -> torch.Tensor:
    """y = x @ W.T (+ bias), float32 accumulation, one rounding to `out_dtype` (default
    float32); x (M, K) on w's device. `sm_count`: the GPU's (default: asked of the device;
    under the interpreter, 1)."""
    n, k = w.shape
    x, out_dtype, empty = gemv_inputs(x, n, out_dtype)
    if empty is not None:
        return empty
    block_g = block_g or default_block_g(k)
    if (k // 32) % block_g:
        raise ValueError(f"persistent_gemv: block_g={block_g} must divide the {k // 32} groups of a row")
    n_rb = triton.cdiv(n, R)
    n_tiles = triton.cdiv(n_rb, block_nb)
    if sm_count is None:
        sm_count = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
    programs = max(1, min(n_tiles, sm_count * programs_per_sm))
    m = x.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    has_bias = bias is not None
    planes = [w.planes[nm] if nm is not None else w.qs for nm in PLANE_ORDER[w.ggml_type.name]]
    _persistent_gemv_kernel[(programs, m)](
        x, w.qs, *planes, bias if has_bias else out, out, m, n, x.stride(0), out.stride(0), n_rb, n_tiles,
        FIELD_ONES, N_GROUPS=k // 32, KIND=w.kind, T=w.words_per_group, RR=R, BLOCK_NB=block_nb, BLOCK_G=block_g,
        HAS_BIAS=has_bias, EVEN_N=n_rb % block_nb == 0, NUM_STAGES=num_stages, num_warps=num_warps,
        **pdl_args(x.device))
    return out
