"""One split's K/V tile, read through a sequence's block table: the load both bodies of the
paged-attention split kernel share (`paged_attention._attend_split`, and the tensor-core
`attend_split_mma.attend_split_mma`)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_split_kv(k_ptr, v_ptr, table, pos, kv_head, split, stride_kp, stride_ks, stride_kh, stride_kd,
                  stride_vp, stride_vs, stride_vh, stride_vd,
                  HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr):
    """(k, v, k_mask): keys split*SPLIT .. +SPLIT-1 of `kv_head` as (SPLIT, BLOCK_D) tiles in
    the cache's dtype, 0 past `pos` and past HEAD_DIM; k_mask marks the keys <= pos. Rows of
    head_dim contiguous elements: vector loads. 64-bit offsets: a large pool (pages × page
    stride) overflows int32."""
    offs_n = tl.arange(0, SPLIT)
    offs_d = tl.arange(0, BLOCK_D)
    keys = split * SPLIT + offs_n
    k_mask = keys <= pos  # the split's first key is <= pos: every head's max is finite
    page = tl.load(table + keys // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
    kv_head64 = kv_head.to(tl.int64)
    row_k = page * stride_kp + (keys % PAGE_SIZE) * stride_ks + kv_head64 * stride_kh
    row_v = page * stride_vp + (keys % PAGE_SIZE) * stride_vs + kv_head64 * stride_vh
    kv_mask = k_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + row_k[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + row_v[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    return k, v, k_mask
