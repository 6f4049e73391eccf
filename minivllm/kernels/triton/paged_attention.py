"""Paged attention in one Triton kernel, for any mix of decode rows and prefill chunks.

Every query row names its sequence (`row_seq`) and its absolute position (`row_pos`);
it attends to keys 0..row_pos of that sequence, read page by page where they lie in
the pool through the sequence's block table. So one launch serves decode (one row per
sequence), a prefill chunk that starts after cached prefix pages, and mixed batches.

Design choices, and why:
- Flash-decoding: one program per (query row, KV head, split of SPLIT_TOKENS keys),
  then a merge kernel per (row, head) that combines the splits' partial softmaxes in
  split order. One program per (row, KV head) walked a row's keys serially and took
  202 µs per layer at a 520-token context on an H200 (7B, 4 KV heads); with splits the
  work per program is a few unrolled key blocks whatever the context. The split is a
  fixed length in tokens, so a row's arithmetic depends only on its own position.
- Each program handles the G = H / KVH query heads of its KV head together: each K/V
  block is loaded once for the whole group and GQA never repeats K/V heads in memory.
- Keys are visited in fixed-size blocks in page order with an online (running max)
  softmax in float32. A row's reduction order depends only on its own position and the
  model's shape, never on how many other rows share the launch: a row's output is
  bitwise the same alone or in any batch (the batch-invariance the engine relies on).
- T4 (sm_75) runs it: no `tl.dot` (tensor-core MMA shapes would need padding the group
  to 16 rows and differ per architecture), only broadcast-multiply + `tl.sum`; all
  arithmetic is float32; bf16 caches are only converted on load, and refused below
  sm_80 where Triton cannot load them.
- CUDA-graph friendly: no host syncs; everything per step (block tables, row_seq,
  row_pos) lives in device tensors a caller may pre-allocate and refill in place, and
  the launch shape depends only on T (rows) and the model.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.errors import ConfigError, DeviceError

# Upper bound on the (group × key block × head_dim) product each program holds at once:
# larger blocks mean fewer loop trips, but the broadcast product lives in registers.
# ptxas for sm_75, G=8 (padded), D=64: 8 keys → 126 registers, 16 keys → 231, 32 keys
# spill; 4096 keeps the common shapes near 128 registers without spilling.
_PRODUCT_ELEMENTS = 4096
# Flash-decoding: each (row, KV head) is split into fixed runs of SPLIT_TOKENS keys, one
# program each, and a second kernel merges the runs' partial softmaxes in split order.
# The split is a length in tokens (never a count), so a row's arithmetic depends only on
# its own position: bitwise the same alone or in any batch. 64 keys keep each program to
# a few unrolled key blocks (latency, not bandwidth, bounds one decode row's attention).
SPLIT_TOKENS = 64
# Splits merged per trip of the merge kernel's loop (a constant, for the same reason).
_MERGE_CHUNK = 16


@triton.jit
def _paged_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, part_ptr, ml_ptr, tables_ptr, row_seq_ptr, row_pos_ptr, scale,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    stride_table, n_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(row_seq_ptr + row)
    pos = tl.load(row_pos_ptr + row)
    split_start = split * SPLIT
    if split_start <= pos:  # splits past the row's position have nothing to do
        # 64-bit offsets: a large pool (pages × page stride) overflows int32.
        row64 = row.to(tl.int64)
        kv_head64 = kv_head.to(tl.int64)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g

        q_offs = row64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
        q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        q = q * scale  # (G, D); scaling q once is cheaper than scaling every score block

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max per query head
        l_i = tl.zeros([BLOCK_G], tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)  # running sum of p · V
        table = tables_ptr + seq.to(tl.int64) * stride_table
        # A fixed trip count (unrolled): the first block holds key split_start <= pos, so
        # m_i is finite after it, and a later block with no key <= pos adds p = 0.
        for start in tl.static_range(0, SPLIT, BLOCK_N):
            keys = split_start + start + offs_n
            k_mask = keys <= pos
            page = tl.load(table + keys // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
            slot = keys % PAGE_SIZE
            kv_mask = k_mask[:, None] & d_mask[None, :]
            k_offs = (page[:, None] * stride_kp + slot[:, None] * stride_ks + kv_head64 * stride_kh
                      + offs_d[None, :] * stride_kd)
            k = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (N, D)
            v_offs = (page[:, None] * stride_vp + slot[:, None] * stride_vs + kv_head64 * stride_vh
                      + offs_d[None, :] * stride_vd)
            v = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0).to(tl.float32)  # (N, D)

            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, N)
            scores = tl.where(k_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new

        # Partial results: unnormalised acc (T, H, splits, D) and (m, l) (T, H, splits, 2).
        part = (row64 * (tl.num_programs(1) * GROUP) + heads[:, None]) * n_splits + split
        tl.store(part_ptr + part * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])
        ml = ((row64 * (tl.num_programs(1) * GROUP) + heads) * n_splits + split) * 2
        tl.store(ml_ptr + ml, m_i, mask=g_mask)
        tl.store(ml_ptr + ml + 1, l_i, mask=g_mask)


@triton.jit
def _paged_attention_merge_kernel(
    part_ptr, ml_ptr, out_ptr, row_pos_ptr,
    stride_ot, stride_oh, stride_od, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr, CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    pos = tl.load(row_pos_ptr + row)
    used = pos // SPLIT + 1  # the row's own splits: independent of the batch
    base = (row.to(tl.int64) * tl.num_programs(1) + head) * n_splits
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, CHUNK)
    m_run = tl.max(tl.full([CHUNK], float("-inf"), tl.float32), axis=0)  # fp32 scalars (loop-carried)
    l_run = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
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
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each query row over its own sequence's paged keys.

    q: (T, H, D) float32 (or float16) queries after RoPE. k_pages, v_pages: one layer's
    (pages, page_size, KVH, D) cache, float32/float16/bfloat16. block_tables: int32
    (B, max_pages), each sequence's pages in order (padding beyond its length is never
    read). row_seq, row_pos: int32 (T,), the sequence index into block_tables and the
    absolute position of each row; the row attends to keys 0..row_pos. The caller must
    already have written the row's own K/V into the pages. scale defaults to D ** -0.5.
    out: optional preallocated (T, H, D) output in q's dtype (for CUDA graphs).
    Returns (T, H, D) in q's dtype.

    Two launches whose shapes depend only on T, the model and block_tables' width (a
    CUDA graph's static buffers fix all three): splits of SPLIT_TOKENS keys, then the
    merge. No host syncs.
    """
    _check_inputs(q, k_pages, v_pages, block_tables, row_seq, row_pos)
    t, h, d = q.shape
    _, page_size, kvh, _ = k_pages.shape
    group = h // kvh
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ConfigError("out", f"{tuple(out.shape)} {out.dtype} on {out.device}",
                          f"must match q: {tuple(q.shape)} {q.dtype} on {q.device}")
    if t == 0:
        return out
    block_g = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(d)
    block_n = min(_key_block(block_g, block_d), SPLIT_TOKENS)
    n_splits = triton.cdiv(block_tables.shape[1] * page_size, SPLIT_TOKENS)
    part = torch.empty((t, h, n_splits, block_d), dtype=torch.float32, device=q.device)
    ml = torch.empty((t, h, n_splits, 2), dtype=torch.float32, device=q.device)
    _paged_attention_split_kernel[(t, kvh, n_splits)](
        q, k_pages, v_pages, part, ml, block_tables, row_seq, row_pos, float(d ** -0.5 if scale is None else scale),
        *q.stride(), *k_pages.stride(), *v_pages.stride(), block_tables.stride(0), n_splits,
        GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=SPLIT_TOKENS,
    )
    _paged_attention_merge_kernel[(t, h)](
        part, ml, out, row_pos, *out.stride(), n_splits,
        HEAD_DIM=d, BLOCK_D=block_d, SPLIT=SPLIT_TOKENS, CHUNK=_MERGE_CHUNK,
    )
    return out


def _key_block(block_g: int, block_d: int) -> int:
    """Keys per loop trip: a power of two in [8, 64] chosen from the model's shape only,
    so it (and with it every row's summation order) never depends on the batch."""
    return max(8, min(64, _PRODUCT_ELEMENTS // (block_g * block_d)))


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
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise DeviceError(f"{kernel} is a Triton GPU kernel and got {device} tensors; move them to a CUDA device "
                      f"(CPU tensors only run under Triton's interpreter: set TRITON_INTERPRET=1 before importing it)")
