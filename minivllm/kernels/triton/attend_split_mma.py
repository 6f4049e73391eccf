"""One split's partial attention for a KV head's query heads on tensor cores (opt-in).

The default split body (`paged_attention._attend_split`) walks the group's query heads
one by one, each a (keys × head_dim) product reduced with `tl.sum`: a serial chain of
FMAs and cross-thread reductions per head. On an H100 that compute, not the K/V bytes,
is most of a batch-1 decode's attention time (7B, 512 keys: 17.1 µs a layer; one query
head a program 9.96; benchmarks/results/h100-s48-run1-attention-sweep.json). Here the
group is one matrix, padded to 16 rows, and both products are `tl.dot` on f16 pieces.

Precision: the same float32 operands as the default body, exactly.
- K and V are f16 (the body is only chosen for f16 caches); a product of two f16 is exact
  in float32, and the MMA accumulates in float32.
- The scaled queries q · scale (float32, as the default body rounds them) and the
  softmax weights p (float32 in (0, 1]) are each cut into three f16 pieces, x = hi +
  mid · 2⁻¹¹ + lo · 2⁻²² (33 bits: every bit of a float32 mantissa). The queries are
  first scaled by a power of two to below 2 in magnitude, so the pieces stay in f16's
  range; all these scalings are exact. A weight below 2⁻²⁴ of the split's max loses bits
  to f16's subnormals: an error under 2⁻⁴⁷ of the max, far below float32's own rounding.
- What differs from the default body is the summation order (the MMA's float32 sums),
  so the bits differ and one engine keeps one choice; a row's bits still depend only on
  the row. Not the f16 rounding of p that flash attention takes, which would be a lower
  precision than asked for.

Only for f16 caches on GPUs whose profile allows `tl.dot` (sm_80+; never the T4 profile),
and only when a launch asks for it (`SplitLaunch(mma=True)`). The engine's launch does by
default (`paged_attention.default_launch`; MINIVLLM_ATTENTION_MMA=0 turns it off): it won
in the engine on an H100 (h100-s49: 7B batch-1 decode 306.5 against 280.1 tok/s).
"""

from __future__ import annotations

import triton
import triton.language as tl

from minivllm.kernels.triton.split_tile import load_split_kv

# tl.dot's smallest M: the group's query heads are padded to this many rows.
MMA_ROWS = 16
# One f16 piece's bits: each piece is the remainder of the ones before, scaled up by 2^11.
PIECE: tl.constexpr = tl.constexpr(2048.0)


@triton.jit
def attend_split_mma(q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, table, scale, row, pos, kv_head, g0, split, n_heads,
                      n_splits, stride_qt, stride_qh, stride_qd, stride_kp, stride_ks, stride_kh, stride_kd,
                      stride_vp, stride_vs, stride_vh, stride_vd,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, HEADS: tl.constexpr):
    """As `_attend_split`: stores the split's unnormalised p · V, max and sum for heads
    g0..g0+HEADS-1 of `kv_head`'s group, computed as (BLOCK_M × keys) matrices."""
    row64 = row.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, BLOCK_M)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < HEADS
    k, v, k_mask = load_split_kv(k_ptr, v_ptr, table, pos, kv_head, split, stride_kp, stride_ks, stride_kh,
                                 stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
                                 HEAD_DIM, PAGE_SIZE, BLOCK_D, SPLIT)  # (SPLIT, D) f16
    heads = kv_head * GROUP + g0 + offs_m
    q = tl.load(q_ptr + row64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # (M, D); padding rows 0
    q = q.to(tl.float32) * scale  # as the default body rounds it
    # A power of two 2^-e with |q| · 2^-e < 2, built from q's largest exponent (exact; no
    # exp2/log2 approximations): the pieces below stay inside f16's range.
    q_max = tl.max(tl.max(tl.abs(q), axis=1), axis=0)
    e = tl.minimum((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF, 253)  # biased exponent
    down = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 2^(127 - e)
    up = (e << 23).to(tl.float32, bitcast=True)  # 2^(e - 127); e = 0 (q all 0): 0, and so are the scores
    scores = dot3(q * down, tl.trans(k)) * up  # (M, SPLIT): q·Kᵀ of the float32 q, float32 sums
    scores = tl.where(k_mask[None, :], scores, float("-inf"))
    m = tl.max(scores, axis=1)  # (M,) finite: the split's first key is <= pos
    p = tl.exp(scores - m[:, None])
    acc = dot3(p, v)  # (M, D): p · V of the float32 p
    part = (row64 * n_heads + heads) * n_splits + split
    tl.store(part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc, mask=m_mask[:, None])
    tl.store(ml_ptr + part * 2, m, mask=m_mask)
    tl.store(ml_ptr + part * 2 + 1, tl.sum(p, axis=1), mask=m_mask)


@triton.jit
def dot3(x, b):
    """x (float32, |x| < 2) times b (f16) on tensor cores, x cut into three f16 pieces
    (hi + mid / 2^11 + lo / 2^22, exact) and the three products summed smallest first."""
    hi = x.to(tl.float16)
    r = (x - hi.to(tl.float32)) * PIECE
    mid = r.to(tl.float16)
    lo = ((r - mid.to(tl.float32)) * PIECE).to(tl.float16)
    acc = tl.dot(lo, b, out_dtype=tl.float32) * (1.0 / PIECE)
    acc = (acc + tl.dot(mid, b, out_dtype=tl.float32)) * (1.0 / PIECE)
    return acc + tl.dot(hi, b, out_dtype=tl.float32)


def mma_block_m(heads: int) -> int:
    """The padded group: tl.dot needs at least MMA_ROWS rows."""
    return max(MMA_ROWS, triton.next_power_of_2(heads))
