"""PagedBatchKV: where K/V rows go and what each row attends to, on CPU and CUDA.

Reference: each row's keys gathered through plain torch indexing of its block table,
and float64 softmax attention written here. `invariant=True` must give bitwise the same
output for a token however its prompt is chunked (one chunk, several, one token at a
time) and whatever else shares the step.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.cache.batch_kv import PagedBatchKV, Segment
from minivllm.cache.page_pool import PagePool

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _pool(device, page_size=4, num_pages=24, dtype=torch.float32) -> PagePool:
    return PagePool(n_layers=2, num_pages=num_pages, page_size=page_size, n_kv_heads=KV_HEADS,
                    head_dim=HEAD_DIM, dtype=dtype, device=device)


def _tokens(n: int, seed: int, device):
    """Per-position q, k, v of one request, fixed so every chunking sees the same rows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
    return q.to(device), k.to(device), v.to(device)


def _reference(q_row, k, v, pos):
    """float64 attention of one row (H, D) over keys 0..pos of k/v (S, KVH, D)."""
    g = HEADS // KV_HEADS
    k64 = k[:pos + 1].double().repeat_interleave(g, dim=1).transpose(0, 1)
    v64 = v[:pos + 1].double().repeat_interleave(g, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hsd->hs", q_row.double(), k64) / HEAD_DIM ** 0.5
    return torch.einsum("hs,hsd->hd", torch.softmax(scores, dim=-1), v64)


# Scattered, out-of-order pages (several runs), as after a while of allocate/release.
TABLE_A = [9, 2, 3, 17, 11]  # 20 slots of page size 4
TABLE_B = [5, 6, 0, 20]


def _run_chunks(pool, layer, chunks_a, chunks_b, qa, ka, va, qb, kb, vb, invariant):
    """Feed request A in `chunks_a` and B in `chunks_b` (zipped into steps: a step holds
    the next chunk of each request that still has one); return each request's rows."""
    out_a, out_b = [], []
    sa = sb = 0
    for step in range(max(len(chunks_a), len(chunks_b))):
        segs, parts = [], []
        if step < len(chunks_a):
            n = chunks_a[step]
            segs.append(Segment(TABLE_A, sa, n))
            parts.append(("a", sa, n))
            sa += n
        if step < len(chunks_b):
            n = chunks_b[step]
            segs.append(Segment(TABLE_B, sb, n))
            parts.append(("b", sb, n))
            sb += n
        src = {"a": (qa, ka, va), "b": (qb, kb, vb)}
        q = torch.cat([src[r][0][s:s + n] for r, s, n in parts])
        k = torch.cat([src[r][1][s:s + n] for r, s, n in parts])
        v = torch.cat([src[r][2][s:s + n] for r, s, n in parts])
        out = PagedBatchKV(pool, segs, invariant=invariant).attend(layer, q, k, v)
        row = 0
        for r, _, n in parts:
            (out_a if r == "a" else out_b).append(out[row:row + n])
            row += n
    return torch.cat(out_a), torch.cat(out_b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("invariant", [False, True])
def test_rows_match_reference(device, invariant):
    pool = _pool(device)
    qa, ka, va = _tokens(19, 1, device)
    qb, kb, vb = _tokens(14, 2, device)
    # A: prefill 8, then 5, then decode; B: prefill 11 then decode (mixed steps).
    out_a, out_b = _run_chunks(pool, 1, [8, 5, 1, 1, 1, 1, 1, 1], [11, 1, 1, 1], qa, ka, va, qb, kb, vb, invariant)
    for out, q, k, v in ((out_a, qa, ka, va), (out_b, qb, kb, vb)):
        for pos in range(out.shape[0]):
            torch.testing.assert_close(out[pos].double(), _reference(q[pos], k, v, pos), rtol=1e-5, atol=1e-5)
    # K/V rows landed where the block tables say.
    ps = pool.page_size
    for table, k in ((TABLE_A, ka), (TABLE_B, kb)):
        for pos in range(k.shape[0]):
            assert torch.equal(pool.k[1, table[pos // ps], pos % ps], k[pos])


@pytest.mark.parametrize("device", DEVICES)
def test_invariant_mode_is_bitwise_independent_of_chunking_and_batch(device):
    # The default path fails this on CPU (chunked SDPA differs in the last bits), which
    # is why invariant mode exists.
    qa, ka, va = _tokens(19, 3, device)
    qb, kb, vb = _tokens(14, 4, device)
    runs = {}
    for name, chunks_a, chunks_b in (
        ("one chunk each", [19], [14]),
        ("chunked, mixed with decode", [7, 6, 1, 1, 1, 1, 1, 1], [3, 1, 1, 9]),
        ("token by token", [1] * 19, [1] * 14),
    ):
        pool = _pool(device)
        runs[name] = _run_chunks(pool, 0, chunks_a, chunks_b, qa, ka, va, qb, kb, vb, invariant=True)
    alone_pool = _pool(device)
    alone = PagedBatchKV(alone_pool, [Segment(TABLE_A, 0, 19)], invariant=True).attend(0, qa, ka, va)
    base_a, base_b = runs["one chunk each"]
    assert torch.equal(alone, base_a), "request A differs when batched with B"
    for name, (out_a, out_b) in runs.items():
        assert torch.equal(out_a, base_a), f"request A differs: {name}"
        assert torch.equal(out_b, base_b), f"request B differs: {name}"


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_metadata_is_built_once_per_step(device):
    pool = _pool(device)
    kv = PagedBatchKV(pool, [Segment(TABLE_A, 12, 1), Segment(TABLE_B, 0, 3)])
    assert kv.block_tables.dtype == kv.row_seq.dtype == kv.row_pos.dtype == torch.int32
    assert kv.block_tables.device.type == torch.device(device).type
    assert kv.block_tables.tolist() == [TABLE_A, TABLE_B + [0]]
    assert kv.row_seq.tolist() == [0, 1, 1, 1]
    assert kv.row_pos.tolist() == [12, 0, 1, 2]
    assert kv.write_slots.tolist() == [17 * 4 + 0, 5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_caches(dtype):
    """f16 on every GPU; bf16 on sm_80+ through the kernel, below sm_80 through SDPA
    (default mode) since Triton cannot load bf16 there."""
    device = "cuda"
    pool = _pool(device, dtype=dtype)
    qa, ka, va = _tokens(19, 5, device)
    qb, kb, vb = _tokens(14, 6, device)
    out_a, _ = _run_chunks(pool, 0, [8, 5, 1, 1, 1, 1, 1, 1], [11, 1, 1, 1], qa, ka, va, qb, kb, vb, invariant=False)
    k16, v16 = ka.to(dtype), va.to(dtype)
    for pos in range(19):
        torch.testing.assert_close(out_a[pos].double(), _reference(qa[pos], k16, v16, pos), rtol=1e-4, atol=1e-4)


def test_a_decode_row_over_scattered_pages_without_the_cpu_kernel_is_the_one_run_result(monkeypatch):
    """Without the compiled kernel (no compiler on the machine), a CPU decode row over
    pages that are not consecutive gathers its keys once and takes the one-run path:
    bitwise the result over consecutive pages, and never the per-page matmuls (two a
    page per layer: a 4096-token context made a row 5-10x slower)."""
    import minivllm.cache.batch_kv as batch_kv
    from minivllm.kernels import cpu_gemv
    from minivllm.kernels.attention import causal_attention

    monkeypatch.setattr(cpu_gemv, "attend_decode_slots", lambda *a: None)
    calls = []

    def one_call(q, k, v, start):
        calls.append(k.shape[0])
        return causal_attention(q, k, v, start)

    monkeypatch.setattr(batch_kv, "causal_attention", one_call)
    n = 18
    q, k, v = _tokens(n, seed=3, device="cpu")
    pool = _pool("cpu")
    scattered, consecutive = TABLE_A, [12, 13, 14, 15, 16]
    for table in (scattered, consecutive):
        slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(n)])
        pool.k[0].view(-1, KV_HEADS, HEAD_DIM)[slots] = k
        pool.v[0].view(-1, KV_HEADS, HEAD_DIM)[slots] = v
    rows = [PagedBatchKV(pool, [Segment(t, n - 1, 1)]).attend_stored(0, q[n - 1:]) for t in (scattered, consecutive)]
    assert calls == [n, n]  # one attention over all the row's keys, scattered or not
    assert torch.equal(rows[0], rows[1])
    torch.testing.assert_close(rows[0][0].double(), _reference(q[n - 1], k, v, n - 1), rtol=1e-5, atol=1e-6)
