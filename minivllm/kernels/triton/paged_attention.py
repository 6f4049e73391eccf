"""Paged attention in Triton, for any mix of decode rows and prefill chunks.

Every query row names its sequence (`row_seq`) and its absolute position (`row_pos`);
it attends to keys 0..row_pos of that sequence, read page by page where they lie in
the pool through the sequence's block table. So one launch serves decode (one row per
sequence), a prefill chunk that starts after cached prefix pages, and mixed batches:
a prefill row is just another row.

Design choices, and why:
- Flash-decoding: a row's keys are cut into splits of SPLIT_TOKENS keys; a split
  kernel computes each (row, KV head, split)'s partial softmax, and a merge kernel per
  (row, head) combines the splits in split order. The split is a fixed length in
  tokens (never a count), so a row's arithmetic depends only on its own position and
  the model's shape: bitwise the same alone or in any batch (the batch invariance the
  engine relies on), whatever the block table's width.
- One split is one 2-D tile: its SPLIT keys × head_dim of K and of V are loaded once
  (rows of head_dim contiguous elements: vector loads), and the GROUP = H / KVH query
  heads of the KV head are walked by a static loop, each with 2-D products reduced by
  `tl.sum` (scores over head_dim, then p · V over keys); the heads' scores sit side by
  side in one (SPLIT, GROUP) tile, so one max and one sum serve the group (each
  cross-warp reduction costs shared memory and barriers). The first version held a
  3-D (heads × 8 keys × head_dim) broadcast product and walked a split in 8 serial
  trips: 49.5 µs per 7B layer at 512 tokens on an H100, for ~1 MB of KV.
- A row's splits are spread over a fixed number of programs per (row, KV head),
  sized from the batch and the GPU's SM count, each looping over every P-th split.
  Under a CUDA graph the block table is as wide as max_model_len, and one program per
  possible split left hundreds of programs per layer that only exit. How many
  programs share the splits never changes a split's arithmetic, so the bits stay
  batch invariant.
- Softmax in float32 with each split's own max; the merge rescales the splits in
  order. T4 (sm_75) runs it: no `tl.dot` (tensor-core MMA shapes would need padding
  the group to 16 rows and differ per architecture); bf16 caches are only converted on
  load, and refused below sm_80 where Triton cannot load them.
- CUDA-graph friendly: no host syncs; everything per step (block tables, row_seq,
  row_pos) lives in device tensors a caller may pre-allocate and refill in place, and
  the launch shape depends only on T (rows), the model, the block table's width and
  the GPU's SM count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.errors import ConfigError, DeviceError
from minivllm.kernels.gpu_profile import triton_interpreting
from minivllm.kernels.triton.attend_split_mma import attend_split_mma, mma_block_m
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers
from minivllm.kernels.triton.split_tile import load_split_kv

# Keys per split, one tile per split. A length in tokens, a multiple of the default
# page size (16): a split reads whole pages. 64 keys × 128 dims is 16 KB of f16 K (and
# as much V) per program, a few hundred programs at 4096 tokens for a 7B layer.
SPLIT_TOKENS = 64
# Programs per SM the split kernel aims for (its third grid axis is sized from it). At
# batch 1 most of a graph-wide grid has no split to do; 2 per SM keeps those to about
# one wave beside the working ones (8 warps at ~180 registers: 1 resident per SM) while
# a 7B row alone still gets a program per split up to 4224 tokens (66 × 64).
_PROGRAMS_PER_SM = 2
# The tensor-core body (4 warps, several resident per SM) aims for 4: a 7B row alone at
# 4096 tokens took 11.2-11.5 µs a layer against 12.3-12.8 at 1 or 2 (512 tokens: the same
# 6.6-7.5 either way; h100-s51-attention-sweep-mma-launches.json).
_PROGRAMS_PER_SM_MMA = 4
# Splits whose K/V one program has in flight when it walks several (batch 8 and 32): the
# loop is software-pipelined through shared memory (sm_80+; 2 stages of a 64 × 128 f16
# K and V tile take ~40 KB on sm_90). A program with one split just loads it.
_SPLIT_STAGES = 2
# Upper bound on the (splits × dims) float32 tile one merge trip holds.
_MERGE_TILE = 8192
# Dims of a head each merge program sums: 32 floats are one 128-byte line of a split's
# partial. With the whole head a program, a 7B batch-1 layer had 28 merge programs, each
# streaming 64 splits × 512 bytes at 4096 tokens in two trips; a program per 32 dims gives
# 112 of a quarter the bytes (h100-s58: 7B after 4,096 tokens 328.6 tok/s against 323.4,
# level after 512). Every program of a head computes the same max and sum; a GPU may round
# a dim's sum over the splits differently for another tile width (the split axis spreads
# over threads by it), so the dims come from head_dim alone, as the trip (`merge_chunk`).
_MERGE_DIMS = 32


@dataclass(frozen=True)
class SplitLaunch:
    """How the split kernel is launched. The engine always uses the defaults; a
    benchmark may sweep them. split_tokens changes the bits (keep it fixed within one
    engine); the other fields never do."""

    split_tokens: int | None = None  # None: SPLIT_TOKENS
    num_warps: int | None = None  # None: from the tile size (split_warps)
    programs_per_sm: int | None = None  # None: _PROGRAMS_PER_SM, or _PROGRAMS_PER_SM_MMA for the MMA body
    num_stages: int = _SPLIT_STAGES  # K/V loads in flight per program (software pipelining)
    maxnreg: int | None = None  # a register cap (2 resident programs per SM at 8 warps: 128)
    heads_per_program: int | None = None  # query heads a program attends for (None: all of its KV head's)
    # With all heads a program: a short row's (split, head) items spread over its programs
    # (the kernel's ADAPTIVE); off until a GPU sweep times it (scripts/attention_bench.py).
    # The engine's default launch takes it under MINIVLLM_ADAPTIVE_HEADS=1 (`default_launch`).
    adaptive_heads: bool = False
    # The group's products on tensor cores (attend_split_mma.py): f16 caches on a profile
    # with tensor_core_dot only, else ignored. Other bits than the plain body's; the
    # engine's default launch takes it (`default_launch`).
    mma: bool = False
    # Splits the merge adds up per trip (None: `merge_chunk`, from the merge's dims alone). Another
    # value changes the bits (the running max and sum step per trip); a sweep may time it.
    merge_splits: int | None = None
    # Dims of a head one merge program sums (None: _MERGE_DIMS; head_dim or more: the whole
    # head, as until h100-s57). Another value may change the bits on a GPU (not a row's
    # dependence on its batch: every row of a launch shares it).
    merge_dims: int | None = None


ADAPTIVE_HEADS_ENV = "MINIVLLM_ADAPTIVE_HEADS"
MMA_ENV = "MINIVLLM_ATTENTION_MMA"
# 0: one merge program per (row, head) over the whole head, as until h100-s57 (an A/B switch
# for a GPU sitting; the default splits the head's dims, `_MERGE_DIMS`).
MERGE_DIMS_ENV = "MINIVLLM_MERGE_DIMS"


def default_launch() -> SplitLaunch:
    """The engine's launch (read per call, so a CUDA graph keeps what it captured):
    - the tensor-core body unless MINIVLLM_ATTENTION_MMA=0 (it applies only to f16 caches
      on a profile with tl.dot); on by default since the h100-s49 sitting, where it took
      7B batch-1 decode from 280.1 to 306.5 tok/s and after-4096 ÷ after-512 from 0.929
      to 0.962 (benchmarks/results/h100-s49-vs-llama-cpp.md);
    - adaptive heads only where MINIVLLM_ADAPTIVE_HEADS=1 asks: they make a row's bits
      follow the batch unless one head a program gives a head the group launch's bits on
      this GPU (`attention_bench --sweep`: bits_equal_all_heads), and they lost in the
      engine (h100-s48)."""
    def flag(name: str, default: str) -> bool:
        return os.environ.get(name, default).strip() != "0"

    whole_head = 1 << 16  # more dims than any head has
    return SplitLaunch(adaptive_heads=flag(ADAPTIVE_HEADS_ENV, "0"), mma=flag(MMA_ENV, "1"),
                       merge_dims=None if flag(MERGE_DIMS_ENV, "1") else whole_head)


@triton.jit
def _paged_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, tables_ptr, row_seq_ptr, row_pos_ptr, scale,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_table, n_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False,
    HPP: tl.constexpr = 0, ADAPTIVE: tl.constexpr = False, MMA: tl.constexpr = False,
):
    """HPP: query heads per program (a divisor of GROUP; 0: all GROUP of the KV head).
    Each head's arithmetic is the same either way; fewer heads a program means more
    programs in flight, each re-reading its KV head's tile (from L2).

    ADAPTIVE (with HPP 0): a row whose (split, head) items fit its KV head's programs, one
    each (a short context at a small batch: most of the grid would idle), takes one head
    an item instead of (split, all heads). The program count follows the batch, so the
    choice does too: fit for batch-invariant mode only where a GPU test shows both give a
    head the same bits."""
    wait_for_producers(PDL)
    HEADS: tl.constexpr = GROUP if HPP == 0 else HPP
    row = tl.program_id(0)
    kv_head = tl.program_id(1) // (GROUP // HEADS)
    g0 = (tl.program_id(1) % (GROUP // HEADS)) * HEADS  # this program's first head of the group
    first = tl.program_id(2)
    pos = tl.load(row_pos_ptr + row)
    seq = tl.load(row_seq_ptr + row)  # issued beside pos: the table row waits on it
    used = pos // SPLIT + 1  # the row's own splits
    n_heads = tl.num_programs(1) * HEADS
    table = tables_ptr + seq.to(tl.int64) * stride_table
    if ADAPTIVE and used * GROUP <= tl.num_programs(2):
        for item in range(first, used * GROUP, tl.num_programs(2)):
            _attend_split(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, table, scale, row, pos, kv_head, item % GROUP,
                          item // GROUP, n_heads, n_splits, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks,
                          stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
                          GROUP, HEAD_DIM, PAGE_SIZE, 1, BLOCK_D, SPLIT, 1)
    elif first < used:  # programs past the row's last split have nothing to do
        # Pipelined (sm_80+: cp.async into shared memory): a program that walks several
        # splits (large batches) loads the next ones' K/V while it computes this one.
        for split in tl.range(first, used, tl.num_programs(2), num_stages=NUM_STAGES):
            if MMA:  # BLOCK_G is then the group padded to tl.dot's 16 rows
                attend_split_mma(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, table, scale, row, pos, kv_head, g0, split,
                                  n_heads, n_splits, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks,
                                  stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
                                  GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_G, BLOCK_D, SPLIT, HEADS)
            else:
                _attend_split(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, table, scale, row, pos, kv_head, g0, split,
                              n_heads, n_splits, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh,
                              stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
                              GROUP, HEAD_DIM, PAGE_SIZE, BLOCK_G, BLOCK_D, SPLIT, HEADS)


@triton.jit
def _attend_split(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, table, scale, row, pos, kv_head, g0, split, n_heads,
                  n_splits, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
                  stride_vp, stride_vs, stride_vh, stride_vd,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, HEADS: tl.constexpr):
    """One split's partial attention for heads g0..g0+HEADS-1 of `kv_head`'s group: its
    (unnormalised p · V, max, sum) stored for the merge."""
    row64 = row.to(tl.int64)  # 64-bit offsets, as in the tile's load
    offs_d = tl.arange(0, BLOCK_D)
    offs_g = tl.arange(0, BLOCK_G)
    d_mask = offs_d < HEAD_DIM
    g_mask = offs_g < HEADS
    k, v, k_mask = load_split_kv(k_ptr, v_ptr, table, pos, kv_head, split, stride_kp, stride_ks, stride_kh,
                                 stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
                                 HEAD_DIM, PAGE_SIZE, BLOCK_D, SPLIT)
    k = k.to(tl.float32)  # (SPLIT, D)
    v = v.to(tl.float32)
    # The group's scores side by side, (SPLIT, G): one max and one sum over the keys
    # serve every head (each head a column of its own; padding columns stay 0, finite,
    # and are never stored).
    scores = tl.zeros([SPLIT, BLOCK_G], tl.float32)
    for g in tl.static_range(HEADS):  # the program's query heads share the tile
        q = tl.load(q_ptr + row64 * stride_qt + (kv_head * GROUP + g0 + g) * stride_qh + offs_d * stride_qd,
                    mask=d_mask, other=0.0)
        q = q.to(tl.float32) * scale  # scaling q once is cheaper than scaling every score
        s = tl.sum(k * q[None, :], axis=1)  # (SPLIT,)
        scores = tl.where(offs_g[None, :] == g, s[:, None], scores)
    scores = tl.where(k_mask[:, None], scores, float("-inf"))
    m = tl.max(scores, axis=0)  # (G,); the split's first key is <= pos, so finite
    p = tl.exp(scores - m[None, :])
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # unnormalised p · V per head
    for g in tl.static_range(HEADS):
        p_g = tl.sum(tl.where(offs_g[None, :] == g, p, 0.0), axis=1)  # column g, exactly
        acc = tl.where(offs_g[:, None] == g, tl.sum(p_g[:, None] * v, axis=0)[None, :], acc)
    # Partial results: acc (T, H, splits, BLOCK_D) and (m, l) (T, H, splits, 2).
    part = (row64 * n_heads + kv_head * GROUP + g0 + offs_g) * n_splits + split
    tl.store(part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
    tl.store(ml_ptr + part * 2, m, mask=g_mask)
    tl.store(ml_ptr + part * 2 + 1, tl.sum(p, axis=0), mask=g_mask)


@triton.jit
def _paged_attention_merge_kernel(
    part_ptr, ml_ptr, out_ptr, row_pos_ptr,
    stride_ot, stride_oh, stride_od, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr, DIMS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """out[row, head, dims] = the row's splits merged in split order, CHUNK a trip: dims
    DIMS * program_id(2) .. + DIMS - 1 of the head (DIMS = BLOCK_D: the whole head). Every
    program of a head computes the same running max and sum."""
    wait_for_producers(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(row_pos_ptr + row)
    used = pos // SPLIT + 1  # the row's own splits: independent of the batch
    base = (row.to(tl.int64) * tl.num_programs(1) + head) * n_splits
    offs_d = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
    offs_c = tl.arange(0, CHUNK)
    m_run = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)  # fp32 scalars (loop-carried)
    l_run = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
    acc = tl.zeros([DIMS], tl.float32)
    # Chunks of CHUNK splits in split order; every row runs the same code per chunk.
    c0 = 0
    while c0 < used:
        s = c0 + offs_c
        s_ok = s < used
        m_s = tl.load(ml_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
        a_s = tl.load(part_ptr + (base + s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m_s, axis=0))
        w_s = tl.where(s_ok, tl.exp(m_s - m_new), 0.0)
        alpha = tl.exp(m_run - m_new)
        l_run = l_run * alpha + tl.sum(w_s * l_s, axis=0)
        acc = acc * alpha + tl.sum(w_s[:, None] * a_s, axis=0)
        m_run = m_new
        c0 += CHUNK
    out = acc / l_run
    o_offs = row.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_tables: torch.Tensor,
                    row_seq: torch.Tensor, row_pos: torch.Tensor, scale: float | None = None,
                    out: torch.Tensor | None = None, *, launch: SplitLaunch | None = None) -> torch.Tensor:
    """Causal attention of each query row over its own sequence's paged keys.

    q: (T, H, D) float32 (or float16) queries after RoPE. k_pages, v_pages: one layer's
    (pages, page_size, KVH, D) cache, float32/float16/bfloat16. block_tables: int32
    (B, max_pages), each sequence's pages in order (padding beyond its length is never
    read). row_seq, row_pos: int32 (T,), the sequence index into block_tables and the
    absolute position of each row; the row attends to keys 0..row_pos. The caller must
    already have written the row's own K/V into the pages. scale defaults to D ** -0.5.
    out: optional preallocated (T, H, D) output in q's dtype (for CUDA graphs).
    launch: the split kernel's launch (benchmarks only; default `default_launch()`).
    Returns (T, H, D) in q's dtype.

    Two launches whose shapes depend only on T, the model, block_tables' width (a CUDA
    graph's static buffers fix these) and the GPU: the splits, then the merge. No host
    syncs.
    """
    _check_inputs(q, k_pages, v_pages, block_tables, row_seq, row_pos)
    launch = launch or default_launch()
    t, h, d = q.shape
    _, page_size, kvh, _ = k_pages.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ConfigError("out", f"{tuple(out.shape)} {out.dtype} on {out.device}",
                          f"must match q: {tuple(q.shape)} {q.dtype} on {q.device}")
    if t == 0:
        return out
    split = launch.split_tokens or SPLIT_TOKENS
    block_d = triton.next_power_of_2(d)
    n_splits = triton.cdiv(block_tables.shape[1] * page_size, split)
    group = h // kvh
    heads = launch.heads_per_program or group
    if group % heads:
        raise ConfigError("heads_per_program", heads, f"must divide the {group} query heads of a KV head")
    head_programs = kvh * (group // heads)
    mma = launch.mma and heads > 1 and _mma_allowed(q, k_pages, v_pages)
    per_sm = launch.programs_per_sm or (_PROGRAMS_PER_SM_MMA if mma else _PROGRAMS_PER_SM)
    programs = split_programs(t * head_programs, n_splits, _sm_count(q.device) * per_sm)
    part = torch.empty((t, h, n_splits, block_d), dtype=torch.float32, device=q.device)
    ml = torch.empty((t, h, n_splits, 2), dtype=torch.float32, device=q.device)
    _paged_attention_split_kernel[(t, head_programs, programs)](
        q, k_pages, v_pages, part, ml, block_tables, row_seq, row_pos, float(d ** -0.5 if scale is None else scale),
        *q.stride(), *k_pages.stride(), *v_pages.stride(), block_tables.stride(0), n_splits,
        GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_G=mma_block_m(heads) if mma else triton.next_power_of_2(heads),
        BLOCK_D=block_d, SPLIT=split, NUM_STAGES=launch.num_stages,
        num_warps=launch.num_warps or split_warps(split, block_d),
        **({} if launch.maxnreg is None else {"maxnreg": launch.maxnreg}), **pdl_args(q.device),
        **({} if heads == group else {"HPP": heads}),
        **({"ADAPTIVE": True} if launch.adaptive_heads and heads == group and group > 1 else {}),
        **({"MMA": True} if mma else {}),
    )
    dims = merge_dims(block_d, launch.merge_dims)
    _paged_attention_merge_kernel[(t, h, block_d // dims)](
        part, ml, out, row_pos, *out.stride(), n_splits,
        HEAD_DIM=d, BLOCK_D=block_d, SPLIT=split, CHUNK=launch.merge_splits or merge_chunk(dims),
        DIMS=dims, **pdl_args(q.device),
    )
    return out


def split_programs(rows_x_kv_heads: int, n_splits: int, target_programs: int) -> int:
    """Programs per (row, KV head) of the split kernel: enough for about
    `target_programs` in all, never more than the splits. Each program takes every
    P-th split of its row, so P never changes the arithmetic (only who does it)."""
    return max(1, min(n_splits, -(-target_programs // rows_x_kv_heads)))


# Warps of the split kernel for 64-key splits, by head_dim, where a sweep measured them:
# on an H100 the 7B shape (head_dim 128) took 17.0 / 20.2 / 20.7 / 114 µs a layer with 2
# warps against 16.9 / 31.1 / 31.5 / 246 with the 8 of the tile-size rule, at context 512
# and 4096, batch 1 and 8 (benchmarks/results/h100-s40-attention-sweep.json). head_dim 64
# (the 0.5B) keeps the rule's 4, which the end-to-end runs used. Warps never change a
# row's bits across batches: every row of a launch shares them.
_MEASURED_WARPS = {(64, 128): 2}


def split_warps(split: int, block_d: int) -> int:
    """Warps of the split kernel: the sweep's choice where there is one, else its K and V
    tiles (split × head_dim float32 each) at about 32 registers per thread apiece."""
    return _MEASURED_WARPS.get((split, block_d), max(1, min(8, split * block_d // 1024)))


def merge_dims(block_d: int, asked: int | None = None) -> int:
    """Dims of a head one merge program sums: `asked` (a launch's merge_dims) or
    _MERGE_DIMS, at most the head (a power of two, as block_d)."""
    return min(block_d, triton.next_power_of_2(asked or _MERGE_DIMS))


def merge_chunk(dims: int) -> int:
    """Splits merged per trip of the merge kernel: a function of the dims a program sums
    (`merge_dims`, from the model's head_dim) only, as the merge's summation order follows
    it; at most _MERGE_TILE floats a trip. 128 for 32 dims: a row of up to 8192 tokens in
    one trip (the whole 7B head took 64: two trips from 4096 tokens)."""
    return max(16, min(128, _MERGE_TILE // dims))


def _mma_allowed(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """The tensor-core body's conditions (attend_split_mma.py): f16 caches (queries f16 or
    float32), and a GPU profile that allows tl.dot (the interpreter, on a CPU, runs it for
    the tests)."""
    if not k_pages.dtype == v_pages.dtype == torch.float16 or q.dtype not in (torch.float16, torch.float32):
        return False
    if q.device.type != "cuda":
        return True
    from minivllm.kernels.gpu_profile import gpu_profile

    return gpu_profile(q.device).tensor_core_dot


_SM_COUNTS: dict[torch.device, int] = {}


def _sm_count(device: torch.device) -> int:
    """The profile's SM count, looked up once per device (a host-side number; the
    launch shape it sizes never changes a row's bits)."""
    if device not in _SM_COUNTS:
        from minivllm.kernels.gpu_profile import gpu_profile

        _SM_COUNTS[device] = gpu_profile(device).sm_count
    return _SM_COUNTS[device]


def _check_inputs(q, k_pages, v_pages, block_tables, row_seq, row_pos) -> None:
    """Shape/dtype/device checks on metadata only: nothing here reads tensor data, so a
    call costs no host sync and can be captured in a CUDA graph."""
    if q.dim() != 3:
        raise ConfigError("q", tuple(q.shape), "expected (rows, n_heads, head_dim)")
    if k_pages.dim() != 4 or k_pages.shape != v_pages.shape:
        raise ConfigError(
            "k_pages/v_pages",
            (tuple(k_pages.shape), tuple(v_pages.shape)),
            "expected two equal shapes (pages, page_size, n_kv_heads, head_dim): one layer of the page pool",
        )
    t, h, d = q.shape
    kvh = k_pages.shape[2]
    if k_pages.shape[3] != d:
        raise ConfigError("head_dim", (d, k_pages.shape[3]), "q and the KV pages must have the same head_dim")
    if h % kvh:
        raise ConfigError("n_heads", h, f"must be a multiple of the cache's n_kv_heads={kvh} (grouped-query attention)")
    if q.dtype not in (torch.float32, torch.float16):
        raise ConfigError("q dtype", q.dtype, "queries must be float32 or float16")
    if k_pages.dtype not in (torch.float32, torch.float16, torch.bfloat16) or v_pages.dtype != k_pages.dtype:
        raise ConfigError(
            "KV cache dtype", (k_pages.dtype, v_pages.dtype), "expected float32, float16 or bfloat16 for both"
        )
    if block_tables.dim() != 2:
        raise ConfigError("block_tables", tuple(block_tables.shape), "expected (sequences, max_pages)")
    for name, index in (("block_tables", block_tables), ("row_seq", row_seq), ("row_pos", row_pos)):
        if index.dtype != torch.int32:
            raise ConfigError(name, index.dtype, "index tensors must be int32 (convert with .to(torch.int32))")
    if row_seq.shape != (t,) or row_pos.shape != (t,):
        raise ConfigError(
            "row_seq/row_pos", (tuple(row_seq.shape), tuple(row_pos.shape)), f"expected ({t},): one entry per query row"
        )
    tensors = {
        "q": q,
        "k_pages": k_pages,
        "v_pages": v_pages,
        "block_tables": block_tables,
        "row_seq": row_seq,
        "row_pos": row_pos,
    }
    require_triton_device(tensors, "paged_attention")
    from minivllm.kernels.gpu_profile import gpu_profile

    if k_pages.dtype == torch.bfloat16 and k_pages.is_cuda and not gpu_profile(k_pages.device).bf16:
        major, minor = gpu_profile(k_pages.device).capability
        raise DeviceError(
            f"paged_attention: a bfloat16 KV cache needs an sm_80+ GPU, but {k_pages.device} is "
            f"sm_{major}{minor} (e.g. a T4); use --activation-dtype f16 or f32 (dtype='float16' / 'float32') "
            f"on this GPU"
        )


def require_triton_device(tensors: dict[str, torch.Tensor], kernel: str) -> None:
    """All tensors on one device, and that device able to run a Triton kernel: a CUDA
    GPU, or the CPU only under Triton's interpreter (TRITON_INTERPRET=1, used by tests)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        raise DeviceError(f"{kernel}: all inputs must be on one device, got {devices}")
    device = next(iter(devices.values()))
    if device.type == "cuda":
        return
    if device.type == "cpu" and triton_interpreting():
        return
    raise DeviceError(f"{kernel} is a Triton GPU kernel and got {device} tensors; move them to a CUDA device "
                      f"(CPU tensors only run under Triton's interpreter: set TRITON_INTERPRET=1 before importing it)")
