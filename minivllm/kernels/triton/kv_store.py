"""Writing a step's keys and values into their page slots, in one Triton launch.

Each row of a step owns one flat slot of the pool (page × page_size + offset, see
cache/batch_kv.py). torch wrote K and V with two `index_copy_` launches per layer
(2 × ~2.2 µs on an H100, 122 µs of a 7B decode step); `store_kv` writes both in one,
and `store_row_heads` is the same store for a kernel that already holds a row's keys
in registers (RoPE, kernels/triton/fused.py), so the write costs no launch at all.

The values are exactly torch's: each is rounded once from its source dtype to the
cache dtype (round to nearest even, as `Tensor.to`). No host syncs; the slots are a
device tensor a CUDA graph may refill in place. No `tl.dot`, no bf16 below sm_80 (the
caller's cache dtype rule, checked by the attention kernel's callers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.errors import ConfigError
from minivllm.kernels.triton.paged_attention import require_triton_device
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers


@triton.jit
def store_row_heads(cache_ptr, slot, stride_cs, stride_ch, heads, dims, values, mask):
    """Store one row's (heads × dims) tile at flat pool slot `slot` (int64) of one
    layer's cache (slots, KVH, D), rounded to the cache's dtype."""
    tl.store(cache_ptr + slot * stride_cs + heads * stride_ch + dims, values.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcs, stride_kch, stride_vcs, stride_vch,
                     KVH: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < KVH) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + row * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + row * stride_vt + heads * stride_vh + dims, mask=mask)
    store_row_heads(kc_ptr, slot, stride_kcs, stride_kch, heads, dims, k, mask)
    store_row_heads(vc_ptr, slot, stride_vcs, stride_vch, heads, dims, v, mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k_cache[slots[i]] = k[i].to(cache dtype), and the same for v, in one launch.

    k, v: (T, KVH, D), last dim contiguous. k_cache, v_cache: one layer's flat cache
    (slots, KVH, D), last dim contiguous. slots: (T,) int64 or int32 flat slot per row.
    """
    t, kvh, d = k.shape
    if (v.shape != k.shape or k_cache.dim() != 3 or k_cache.shape[1:] != (kvh, d) or v_cache.shape != k_cache.shape
            or slots.shape != (t,)):
        raise ConfigError("store_kv shapes", (tuple(k.shape), tuple(v.shape), tuple(k_cache.shape),
                                              tuple(v_cache.shape), tuple(slots.shape)),
                          "expected k, v (T, KVH, D), caches (slots, KVH, D) and one slot per row")
    if any(x.stride(-1) != 1 for x in (k, v, k_cache, v_cache)):
        raise ConfigError("store_kv strides", "last dim not contiguous", "pass tensors whose head_dim is contiguous")
    require_triton_device({"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache, "slots": slots}, "store_kv")
    if t:
        _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
                               KVH=kvh, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(kvh),
                               BLOCK_D=triton.next_power_of_2(d), num_warps=1 if kvh * d <= 512 else 2,
                               **pdl_args(k.device))
