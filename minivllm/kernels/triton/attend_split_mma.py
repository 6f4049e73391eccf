"""One split's partial attention for a KV head's query heads on tensor cores (opt-in).

The default split body (`paged_attention._attend_split`) walks the group's query heads
one by one, each a (keys × head_dim) product reduced with `tl.sum`: a serial chain of
FMAs and cross-thread reductions per head. On an H100 that compute, not the K/V bytes,
is most of a batch-1 decode's attention time (7B: one query head a program takes 9.9 µs
a layer against 16.8 for all seven; benchmarks/results/h100-s48-run1-attention-sweep).
Here the group is one matrix, padded to 16 rows, and both products are `tl.dot`.

Precision (the user asked for float32 attention math on f16 K/V):
- q · Kᵀ: q and K are f16; a product of two f16 is exact in float32 and the MMA
  accumulates in float32. The softmax scale is applied to the float32 scores (the default
  body scales q in float32 first: a different rounding, the same precision).
- p · V: p is float32 in (0, 1]. It is split into p_hi = f16(p) and p_lo = f16((p - p_hi)
  · 2¹¹), two f16 MMAs accumulating in float32 (p_lo's product scaled back by 2⁻¹¹, exact),
  so every weight carries about 22 of its 24 bits, down to weights of 2⁻²⁴ (the scaling
  keeps p_lo out of f16's subnormals). No f16 rounding of p alone, which is the shortcut
  flash attention takes and which would be a lower precision than asked for.

Only for f16 queries and caches on GPUs whose profile allows `tl.dot` (sm_80+; never the
T4 profile), and only when a launch asks for it (`SplitLaunch(mma=True)`, or
MINIVLLM_ATTENTION_MMA=1 for the engine) until a GPU run shows it wins. Bits differ from
the default body's (another summation order), so one engine keeps one choice; a row's
bits still depend only on the row.
"""

from __future__ import annotations

import triton
import triton.language as tl

# tl.dot's smallest M: the group's query heads are padded to this many rows.
MMA_ROWS = 16
# p's low half is scaled by 2^11 (f16's mantissa) before its f16 rounding.
LO_SCALE: tl.constexpr = tl.constexpr(2048.0)


@triton.jit
def _attend_split_mma(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, table, scale, row, pos, kv_head, g0, split, n_heads,
                      n_splits, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
                      stride_vp, stride_vs, stride_vh, stride_vd,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, HEADS: tl.constexpr):
    """As `_attend_split`: stores the split's unnormalised p · V, max and sum for heads
    g0..g0+HEADS-1 of `kv_head`'s group, computed as (BLOCK_M × keys) matrices."""
    row64 = row.to(tl.int64)
    kv_head64 = kv_head.to(tl.int64)
    offs_n = tl.arange(0, SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < HEADS
    keys = split * SPLIT + offs_n
    k_mask = keys <= pos  # the split's first key is <= pos: every head's max is finite
    page = tl.load(table + keys // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
    row_k = page * stride_kp + (keys % PAGE_SIZE) * stride_ks + kv_head64 * stride_kh
    row_v = page * stride_vp + (keys % PAGE_SIZE) * stride_vs + kv_head64 * stride_vh
    kv_mask = k_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + row_k[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # (SPLIT, D) f16
    v = tl.load(v_ptr + row_v[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    heads = kv_head * GROUP + g0 + offs_m
    q = tl.load(q_ptr + row64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # (M, D) f16; padding rows 0
    scores = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale  # (M, SPLIT): exact products, f32 sums
    scores = tl.where(k_mask[None, :], scores, float("-inf"))
    m = tl.max(scores, axis=1)  # (M,) finite: the split's first key is <= pos
    p = tl.exp(scores - m[:, None])
    p_hi = p.to(tl.float16)
    # The remainder scaled by 2^11 (exact) into f16's normal range: unscaled, a weight
    # below 0.25 would leave its low half subnormal, and below 6e-8 nothing at all.
    p_lo = ((p - p_hi.to(tl.float32)) * LO_SCALE).to(tl.float16)
    acc = tl.dot(p_hi, v, out_dtype=tl.float32)
    acc += tl.dot(p_lo, v, out_dtype=tl.float32) * (1.0 / LO_SCALE)  # (M, D): p · V, p's low bits too
    part = (row64 * n_heads + heads) * n_splits + split
    tl.store(part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=m_mask[:, None])
    tl.store(ml_ptr + part * 2, m, mask=m_mask)
    tl.store(ml_ptr + part * 2 + 1, tl.sum(p, axis=1), mask=m_mask)


def mma_block_m(heads: int) -> int:
    """The padded group: tl.dot needs at least MMA_ROWS rows."""
    return max(MMA_ROWS, triton.next_power_of_2(heads))
