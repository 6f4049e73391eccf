"""The Triton paged-attention kernel against float32/float64 references, on scattered pages.

CPU variants run the kernel through Triton's interpreter; `cuda` variants run the
compiled kernel. The interpreter is switched on only where there is no GPU, because
the switch is read when the kernel module is imported: on the GPU machine the CUDA
variants must test the compiled code, not the interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
from paged_attention_cases import HEAD_DIM, MODEL_SHAPES, kernel_device, plain_attention, scattered_pages, sequence_kv
from triton_devices import DEVICES, INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.errors import ConfigError, DeviceError  # noqa: E402
from minivllm.kernels.attention import causal_attention  # noqa: E402
from minivllm.kernels.gpu_profile import gpu_profile  # noqa: E402 (the T4 profile decides as a T4 would)
from minivllm.kernels.triton import paged_attention as pa  # noqa: E402
from minivllm.kernels.triton.paged_attention import paged_attention  # noqa: E402

# (n_heads, n_kv_heads) of SmolLM2-135M and Qwen2.5-0.5B.
GQA_SHAPES = [(9, 3), (14, 2)]


@pytest.fixture
def device(request) -> torch.device:
    return kernel_device(request.param)


def _mixed_rows(seq_lens: list[int]) -> tuple[list[int], list[int]]:
    """Rows of a mixed step: decode rows (last position) for sequences 0 and 2, and for
    sequence 1 a prefill chunk of its last 6 tokens after a cached prefix; also the very
    first position (a row that sees one key)."""
    rows = [(0, seq_lens[0] - 1)]
    rows += [(1, p) for p in range(seq_lens[1] - 6, seq_lens[1])]
    rows += [(2, seq_lens[2] - 1), (2, 0)]
    return [s for s, _ in rows], [p for _, p in rows]


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("heads,kv_heads", GQA_SHAPES)
def test_mixed_batch_matches_references(device, page_size, heads, kv_heads):
    seq_lens = [37, 70, 16]  # 16: a sequence that exactly fills its page
    k, v, tables, table_lists = scattered_pages(seq_lens=seq_lens, page_size=page_size, kvh=kv_heads,
                                       dtype=torch.float32, device=device, seed=page_size + heads)
    row_seq, row_pos = _mixed_rows(seq_lens)
    q = torch.randn(len(row_seq), heads, HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(device)
    out = paged_attention(q, k, v, tables, torch.tensor(row_seq, dtype=torch.int32, device=device),
                          torch.tensor(row_pos, dtype=torch.int32, device=device))
    assert out.shape == q.shape and out.dtype == torch.float32
    for i, (s, p) in enumerate(zip(row_seq, row_pos)):
        ks, vs = sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
        torch.testing.assert_close(out[i], causal_attention(q[i:i + 1], ks, vs, p)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out[i].double(), plain_attention(q[i], ks, vs), rtol=1e-5, atol=1e-5)
    # The prefill chunk of sequence 1 as the engine's SDPA path sees it: one call, q_start = 64.
    chunk = [i for i, s in enumerate(row_seq) if s == 1]
    n1 = seq_lens[1]
    ref = causal_attention(q[chunk], sequence_kv(k, table_lists[1], n1), sequence_kv(v, table_lists[1], n1), n1 - 6)
    torch.testing.assert_close(out[chunk], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_rows_are_batch_invariant_bitwise(device):
    """A row's output is the same bits alone, in the full batch, and among other rows
    in another order: its reduction never depends on T or on its neighbours."""
    seq_lens = [37, 70, 16]
    k, v, tables, _ = scattered_pages(
        seq_lens=seq_lens, page_size=16, kvh=3, dtype=torch.float32, device=device, seed=3)
    row_seq, row_pos = _mixed_rows(seq_lens)
    q = torch.randn(len(row_seq), 9, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(device)

    def run(rows: list[int]) -> torch.Tensor:
        seq = torch.tensor([row_seq[i] for i in rows], dtype=torch.int32, device=device)
        pos = torch.tensor([row_pos[i] for i in rows], dtype=torch.int32, device=device)
        return paged_attention(q[rows].contiguous(), k, v, tables, seq, pos)

    full = run(list(range(len(row_seq))))
    for i in (0, 4, len(row_seq) - 1):
        assert torch.equal(run([i])[0], full[i]), f"row {i} differs when run alone"
    shuffled = [5, 0, 8, 3, 3]
    for j, out in enumerate(run(shuffled)):
        assert torch.equal(out, full[shuffled[j]]), f"row {shuffled[j]} differs inside another batch"


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_half_caches_and_half_queries(device, cache_dtype):
    if cache_dtype == torch.bfloat16 and device.type == "cuda" and gpu_profile(device).capability < (8, 0):
        pytest.skip("bf16 caches are refused below sm_80 (tested in test_bf16_refused_below_sm80)")
    seq_lens = [40, 23]
    k, v, tables, table_lists = scattered_pages(
        seq_lens=seq_lens, page_size=16, kvh=2, dtype=cache_dtype, device=device, seed=5)
    row_seq, row_pos = [0, 1, 1], [39, 22, 10]
    q = torch.randn(3, 14, HEAD_DIM, generator=torch.Generator().manual_seed(2)).to(device)
    seq = torch.tensor(row_seq, dtype=torch.int32, device=device)
    pos = torch.tensor(row_pos, dtype=torch.int32, device=device)
    out32 = paged_attention(q, k, v, tables, seq, pos)
    out16 = paged_attention(q.half(), k, v, tables, seq, pos)
    assert out16.dtype == torch.float16
    for i, (s, p) in enumerate(zip(row_seq, row_pos)):
        ref = plain_attention(q[i], sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1))
        torch.testing.assert_close(out32[i].double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            out16[i].double(),
            plain_attention(
                q[i].half(), sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
            ),
            rtol=2e-3,
            atol=2e-3,
        )


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_preallocated_output_is_filled(device):
    k, v, tables, table_lists = scattered_pages(
        seq_lens=[20], page_size=16, kvh=3, dtype=torch.float32, device=device, seed=9)
    q = torch.randn(2, 9, HEAD_DIM, device=device)
    out = torch.full_like(q, float("nan"))
    result = paged_attention(q, k, v, tables, torch.zeros(2, dtype=torch.int32, device=device),
                             torch.tensor([19, 4], dtype=torch.int32, device=device), out=out)
    assert result.data_ptr() == out.data_ptr()
    ref = plain_attention(q[1], sequence_kv(k, table_lists[0], 5), sequence_kv(v, table_lists[0], 5))
    torch.testing.assert_close(out[1].double(), ref, rtol=1e-5, atol=1e-5)
    assert not out.isnan().any()


def test_bad_inputs_get_clear_errors(monkeypatch):
    k = torch.zeros(4, 16, 3, HEAD_DIM)
    q = torch.zeros(2, 9, HEAD_DIM)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    seq = torch.zeros(2, dtype=torch.int32)
    pos = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ConfigError, match="row_pos.*int32"):
        paged_attention(q, k, k, tables, seq, pos.long())
    with pytest.raises(ConfigError, match="n_heads.*multiple"):
        paged_attention(torch.zeros(2, 8, HEAD_DIM), k, k, tables, seq, pos)
    with pytest.raises(ConfigError, match="one entry per query row"):
        paged_attention(q, k, k, tables, seq[:1], pos[:1])
    with pytest.raises(ConfigError, match="head_dim"):
        paged_attention(torch.zeros(2, 9, 32), k, k, tables, seq, pos)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError, match="Triton GPU kernel.*CUDA device"):
        paged_attention(q, k, k, tables, seq, pos)


@pytest.mark.cuda
def test_cpu_and_cuda_mixed_inputs_refused():
    k = torch.zeros(4, 16, 3, HEAD_DIM, device="cuda")
    with pytest.raises(DeviceError, match="one device"):
        paged_attention(
            torch.zeros(1, 9, HEAD_DIM),
            k,
            k,
            torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
            torch.zeros(1, dtype=torch.int32, device="cuda"),
            torch.zeros(1, dtype=torch.int32, device="cuda"),
        )


@pytest.mark.cuda
def test_bf16_refused_below_sm80():
    if gpu_profile().capability >= (8, 0):
        pytest.skip("this GPU supports bf16 (sm_80+); the refusal is for T4-class GPUs")
    k = torch.zeros(4, 16, 3, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(DeviceError, match="bfloat16.*sm_80"):
        paged_attention(torch.zeros(1, 9, HEAD_DIM, device="cuda"), k, k, idx.view(1, 1), idx, idx)


@pytest.mark.cuda
def test_replays_in_a_cuda_graph_with_refilled_metadata():
    """Captured once with static metadata buffers; refilling row_pos/row_seq/block
    tables in place and replaying gives the new step's answer (no host syncs inside)."""
    if INTERPRETED:
        pytest.fail("TRITON_INTERPRET=1 is set: a CUDA graph needs the compiled kernel")
    device = torch.device("cuda")
    k, v, tables, table_lists = scattered_pages(
        seq_lens=[60, 33], page_size=16, kvh=3, dtype=torch.float16, device=device, seed=11
    )
    q = torch.randn(2, 9, HEAD_DIM, device=device)
    seq = torch.tensor([0, 1], dtype=torch.int32, device=device)
    pos = torch.tensor([10, 5], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    paged_attention(q, k, v, tables, seq, pos, out=out)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(q, k, v, tables, seq, pos, out=out)
    for step_pos in ([59, 32], [20, 31]):
        pos.copy_(torch.tensor(step_pos, dtype=torch.int32))
        q.copy_(torch.randn(2, 9, HEAD_DIM))
        graph.replay()
        torch.cuda.synchronize()
        for i, (s, p) in enumerate(zip([0, 1], step_pos)):
            ref = plain_attention(q[i], sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1))
            torch.testing.assert_close(out[i].double(), ref, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("split", [16, None], ids=["split16", "default-split"])
def test_long_rows_across_many_splits(device, split, monkeypatch):
    """Flash-decoding: rows longer than one split (and, with 16-token splits, more
    splits than one merge trip takes) match float64 attention, and stay bitwise the
    same alone as in the batch, whatever the other rows' lengths."""
    from minivllm.kernels.triton import paged_attention as pa

    if split is not None:
        monkeypatch.setattr(pa, "SPLIT_TOKENS", split)
        monkeypatch.setattr(pa, "_MERGE_TILE", 512)  # 16 splits a merge trip: 300 keys take two
        assert pa.merge_chunk(pa.merge_dims(HEAD_DIM)) == 16
    seq_lens = [300, 45, 129]
    k, v, tables, table_lists = scattered_pages(
        seq_lens=seq_lens, page_size=16, kvh=2, dtype=torch.float32, device=device,
                                       seed=17)
    row_seq = [0, 1, 2, 0, 2]
    row_pos = [299, 44, 128, 63, 64]  # split boundaries: the 64th and 65th keys
    q = torch.randn(len(row_seq), 6, HEAD_DIM, generator=torch.Generator().manual_seed(18)).to(device)

    def run(rows):
        seq = torch.tensor([row_seq[i] for i in rows], dtype=torch.int32, device=device)
        pos = torch.tensor([row_pos[i] for i in rows], dtype=torch.int32, device=device)
        return paged_attention(q[rows].contiguous(), k, v, tables, seq, pos)

    full = run(list(range(len(row_seq))))
    for i, (s, p) in enumerate(zip(row_seq, row_pos)):
        ks, vs = sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
        torch.testing.assert_close(full[i].double(), plain_attention(q[i], ks, vs), rtol=1e-5, atol=1e-5)
    for i in range(len(row_seq)):
        assert torch.equal(run([i])[0], full[i]), f"row {i} differs when run alone"
    # A narrower block table (fewer splits in the grid) gives the same bits for the short row.
    seq1 = torch.tensor([0], dtype=torch.int32, device=device)
    narrow = paged_attention(q[1:2].contiguous(), k, v, tables[1:2, :3].contiguous(), seq1,
                             torch.tensor([44], dtype=torch.int32, device=device))
    assert torch.equal(narrow[0], full[1])


# (n_heads, n_kv_heads, head_dim) of Qwen2.5-7B and Qwen2.5-0.5B: group 7.


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", MODEL_SHAPES)
@pytest.mark.parametrize("heads_per_program", [None, 1], ids=["group-per-program", "head-per-program"])
def test_model_shapes_match_float64_attention(device, heads, kv_heads, head_dim, cache_dtype, heads_per_program):
    """The real models' shapes (group 7, head_dim 128 and 64) with a CUDA graph's wide
    block table (most programs have no split to do): decode rows whose keys end on both
    sides of page and split boundaries, beside a prefill chunk that crosses both, each
    against softmax attention in float64 over its sequence's dense keys; with a
    program per KV head (its 7 query heads) and a program per query head."""
    seq_lens = [150, 70, 16, 129, 1]
    k, v, tables, table_lists = scattered_pages(seq_lens=seq_lens, page_size=16, kvh=kv_heads, dtype=cache_dtype,
                                       device=device, seed=heads + head_dim, head_dim=head_dim, width=24)
    rows = [(0, 149), (2, 15), (3, 128), (4, 0), (3, 63)] + [(1, p) for p in range(61, 67)]
    q = torch.randn(len(rows), heads, head_dim, generator=torch.Generator().manual_seed(4)).to(device)
    out = paged_attention(q, k, v, tables, torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device),
                          torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device),
                          launch=pa.SplitLaunch(heads_per_program=heads_per_program))
    if heads_per_program is not None:
        with pytest.raises(ConfigError, match="heads_per_program"):
            paged_attention(q, k, v, tables, torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device),
                            torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device),
                            launch=pa.SplitLaunch(heads_per_program=2))  # 2 does not divide 7
    for i, (s, p) in enumerate(rows):
        ks, vs = sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
        torch.testing.assert_close(out[i].double(), plain_attention(q[i], ks, vs), rtol=1e-5, atol=1e-5)


def _rows_of_one_to_three_splits(device, dtype, seed):
    """7B-shaped pages of two sequences (150 and 70 keys) and four decode rows over them,
    ending in the first, second and third 64-key split: (k, v, tables, table_lists, rows,
    q, seq, pos)."""
    heads, kv_heads, head_dim = MODEL_SHAPES[0].values
    k, v, tables, table_lists = scattered_pages(seq_lens=[150, 70], page_size=16, kvh=kv_heads, dtype=dtype,
                                                device=device, seed=seed, head_dim=head_dim, width=12)
    rows = [(0, 149), (0, 64), (1, 69), (1, 0)]
    q = torch.randn(len(rows), heads, head_dim, generator=torch.Generator().manual_seed(seed + 2)).to(device)
    seq = torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device)
    pos = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device)
    return k, v, tables, table_lists, rows, q, seq, pos


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_a_merge_of_two_splits_a_trip_matches_float64_attention(device):
    """`SplitLaunch(merge_splits=2)` (a sweep's option): rows of up to three 64-key splits
    merged two a trip, the running max and sum carried across trips, against float64."""
    k, v, tables, table_lists, rows, q, seq, pos = _rows_of_one_to_three_splits(device, torch.float32, 3)
    out = paged_attention(q, k, v, tables, seq, pos, launch=pa.SplitLaunch(merge_splits=2))
    for i, (s, p) in enumerate(rows):
        ks, vs = sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
        torch.testing.assert_close(out[i].double(), plain_attention(q[i], ks, vs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("merge_splits", [2, None], ids=["two-a-trip", "default-trip"])
def test_merge_programs_per_head_slice_match_float64_and_keep_a_rows_bits(device, merge_splits):
    """The merge split over a head's dims (`merge_dims` 32, the default, and 64: 4 and 2
    programs a 7B head; the whole head) matches float64 attention for rows of 1 to 3
    splits, and a row alone gets its bits in the batch. Under the interpreter every dims
    split gives the whole head's bits (each dim's sums are its own); a GPU lays the split
    axis out over threads by the tile's width, so its sums may round differently
    (h100-s58), which one engine never mixes: the dims come from head_dim alone."""
    k, v, tables, table_lists, rows, q, seq, pos = _rows_of_one_to_three_splits(device, torch.float16, 8)

    def run(dims):
        return paged_attention(q, k, v, tables, seq, pos,
                               launch=pa.SplitLaunch(merge_dims=dims, merge_splits=merge_splits or 64))

    whole = run(1 << 16)
    for dims in (1 << 16, 32, 64, None):
        out = run(dims)
        for i, (s, p) in enumerate(rows):
            ks, vs = sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
            torch.testing.assert_close(out[i].double(), plain_attention(q[i], ks, vs), rtol=1e-5, atol=1e-5)
        if device.type == "cpu":
            assert torch.equal(out, whole), f"merge_dims={dims}"
    full = run(None)
    for i in range(len(rows)):
        alone = paged_attention(q[i:i + 1].contiguous(), k, v, tables, seq[i:i + 1], pos[i:i + 1],
                                launch=pa.SplitLaunch(merge_splits=merge_splits or 64))
        assert torch.equal(alone[0], full[i]), f"row {i} alone"


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("heads,kv_heads,head_dim", MODEL_SHAPES)
def test_adaptive_heads_match_float64_and_the_fixed_launches_bit_for_bit(device, heads, kv_heads, head_dim,
                                                                         monkeypatch):
    """`SplitLaunch(adaptive_heads=True)`: a row whose (split, head) items fit its KV head's
    programs takes one head an item, any other row its splits with the whole group.
    Reference: float64 attention for every row; and per row, the bits of the fixed launch
    its choice stands for (one head a program for the short rows, the default for the
    others), a head's arithmetic being the same helper either way. By hand: 6 rows, a
    64-page table (16 splits of 64 keys), 2 programs a SM on 42 x kv_heads SMs: 14 programs
    per (row, KV head); a row is short when its splits x 7 <= 14: positions 0-127."""
    monkeypatch.setenv(pa.MMA_ENV, "0")  # the plain body's launches (the tensor-core body has its own tests)
    seq_lens = [150, 70, 16, 129, 1]
    k, v, tables, table_lists = scattered_pages(seq_lens=seq_lens, page_size=16, kvh=kv_heads, dtype=torch.float16,
                                       device=device, seed=7 + head_dim, head_dim=head_dim, width=64)
    rows = [(0, 149), (2, 15), (3, 128), (4, 0), (1, 63), (3, 127)]
    q = torch.randn(len(rows), heads, head_dim, generator=torch.Generator().manual_seed(8)).to(device)
    seq = torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device)
    pos = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device)
    monkeypatch.setitem(pa._SM_COUNTS, torch.device(device), 42 * kv_heads)
    assert pa.split_programs(6 * kv_heads, 16, 2 * 42 * kv_heads) == 14
    short = [p < 128 for _, p in rows]
    assert short == [False, True, False, True, True, True]
    adaptive = paged_attention(q, k, v, tables, seq, pos, launch=pa.SplitLaunch(adaptive_heads=True))
    per_head = paged_attention(q, k, v, tables, seq, pos, launch=pa.SplitLaunch(heads_per_program=1))
    grouped = paged_attention(q, k, v, tables, seq, pos)
    for i, (s, p) in enumerate(rows):
        ks, vs = sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
        torch.testing.assert_close(adaptive[i].double(), plain_attention(q[i], ks, vs), rtol=1e-5, atol=1e-5)
        assert torch.equal(adaptive[i], per_head[i] if short[i] else grouped[i]), (i, short[i])
    monkeypatch.setenv(pa.ADAPTIVE_HEADS_ENV, "1")  # the engine's switch: its default launch becomes adaptive
    assert pa.default_launch() == pa.SplitLaunch(adaptive_heads=True)
    assert torch.equal(paged_attention(q, k, v, tables, seq, pos), adaptive)
    monkeypatch.delenv(pa.ADAPTIVE_HEADS_ENV)
    monkeypatch.setitem(pa._SM_COUNTS, torch.device(device), 1)  # one program per (row, KV head): no row fits
    assert torch.equal(paged_attention(q, k, v, tables, seq, pos, launch=pa.SplitLaunch(adaptive_heads=True)),
                       paged_attention(q, k, v, tables, seq, pos))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("mma", ["1", "0"])
def test_row_bits_same_alone_and_in_a_batch_of_8(device, mma, monkeypatch):
    """7B shape, f16 cache, graph-wide tables: each decode row gives the same bits alone
    as among 7 other rows at other positions, and whether its splits are spread over
    many programs or all walked by one (the program count follows the batch and the GPU).
    With the engine's default launch (the tensor-core body where the GPU allows it) and
    with the plain body (MINIVLLM_ATTENTION_MMA=0)."""
    from minivllm.kernels.triton import paged_attention as pa

    monkeypatch.setenv(pa.MMA_ENV, mma)

    seq_lens = [300, 5, 64, 65, 17, 128, 200, 1]
    k, v, tables, _ = scattered_pages(
        seq_lens=seq_lens, page_size=16, kvh=4, dtype=torch.float16, device=device, seed=21,
                             head_dim=128, width=24)
    q = torch.randn(8, 28, 128, generator=torch.Generator().manual_seed(22)).half().float().to(device)
    pos = torch.tensor([n - 1 for n in seq_lens], dtype=torch.int32, device=device)
    seq = torch.arange(8, dtype=torch.int32, device=device)
    batch = paged_attention(q, k, v, tables, seq, pos)
    for i in (0, 7):
        alone = paged_attention(q[i:i + 1].contiguous(), k, v, tables, seq[i:i + 1], pos[i:i + 1])
        assert torch.equal(alone[0], batch[i]), f"row {i} differs alone"
    assert pa.split_programs(8 * 4, 6, 4 * 132) == 6  # every split its own program here
    monkeypatch.setitem(pa._SM_COUNTS, torch.device(device), 1)
    assert pa.split_programs(8 * 4, 6, 4) == 1  # and now one program walks all of a row's splits
    assert torch.equal(paged_attention(q, k, v, tables, seq, pos), batch)


_COMPILE = r"""
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton import paged_attention as pa
# Pointers and the strides a real launch has as multiples of 16 (Triton specialises
# those, and the vector loads depend on it); stride 1 is a constant, as at run time.
attrs = {(i,): [["tt.divisibility", 16]] for i in list(range(8)) + [9, 10, 12, 13, 14, 16, 17, 18]}
out = {}
for cc in (75, 90):
    target = GPUTarget("cuda", cc, 32 if cc < 90 else 128)
    for cache, (g, d) in [("*fp16", (7, 128)), ("*fp32", (7, 64)), ("*fp16", (1, 64))]:
        sig = {n: "*fp32" for n in ("q_ptr", "part_ptr", "ml_ptr")}
        sig.update({"k_ptr": cache, "v_ptr": cache, "tables_ptr": "*i32", "row_seq_ptr": "*i32",
                    "row_pos_ptr": "*i32", "scale": "fp32"})
        for n in ("stride_qt", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp", "stride_vs",
                  "stride_vh", "stride_table", "n_splits"):
            sig[n] = "i32"
        const = {"stride_qd": 1, "stride_kd": 1, "stride_vd": 1, "GROUP": g, "HEAD_DIM": d, "PAGE_SIZE": 16,
                 "BLOCK_G": triton.next_power_of_2(g), "BLOCK_D": d, "SPLIT": pa.SPLIT_TOKENS,
                 "NUM_STAGES": pa.SplitLaunch().num_stages, "PDL": cc >= 90, "HPP": 0, "ADAPTIVE": g > 1,
                 "MMA": False}
        sig.update({k: "constexpr" for k in const})
        k = triton.compile(ASTSource(pa._paged_attention_split_kernel, sig, const, attrs=attrs), target=target,
                           options={"num_warps": pa.split_warps(pa.SPLIT_TOKENS, d)})
        out[f"sm{cc}/split/{cache}/{g}x{d}"] = k.asm["ptx"]
        if cc >= 80 and cache == "*fp16" and g > 1:  # the opt-in tensor-core body (float32 queries)
            const.update({"MMA": True, "ADAPTIVE": False, "BLOCK_G": 16})
            k = triton.compile(ASTSource(pa._paged_attention_split_kernel, sig, const, attrs=attrs), target=target,
                               options={"num_warps": pa.split_warps(pa.SPLIT_TOKENS, d)})
            out[f"sm{cc}/split-mma/{cache}/{g}x{d}"] = k.asm["ptx"]
        sig = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*fp16", "row_pos_ptr": "*i32",
               "stride_ot": "i32", "stride_oh": "i32", "stride_od": "i32", "n_splits": "i32"}
        const = {"HEAD_DIM": d, "BLOCK_D": d, "SPLIT": pa.SPLIT_TOKENS, "CHUNK": pa.merge_chunk(pa.merge_dims(d)),
                 "PDL": cc >= 90, "DIMS": pa.merge_dims(d)}
        sig.update({k: "constexpr" for k in const})
        merge_attrs = {(i,): [["tt.divisibility", 16]] for i in range(6)}
        k = triton.compile(ASTSource(pa._paged_attention_merge_kernel, sig, const, attrs=merge_attrs), target=target,
                           options={"num_warps": 4})
        out[f"sm{cc}/merge/{d}"] = k.asm["ptx"]
print(json.dumps({key: {"target": f".target sm_{key[2:4]}" in p, "bf16": "bf16" in p, "mma": "mma." in p,
                        "gdc": "griddepcontrol.wait" in p,
                        # 16-byte loads, direct or (pipelined, sm_80+) through cp.async
                        "vector_loads": "ld.global.v4" in p or "ld.global.nc.v4" in p
                        or re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10,", p) is not None}
                  for key, p in out.items()}))
"""


def test_kernels_compile_for_t4_sm75_and_h100_sm90_without_bf16_or_mma():
    """Both flash-decoding kernels compile to sm_75 PTX (a Kaggle T4) and sm_90 (H100)
    with no bf16 and no tensor-core instructions (but for the opt-in tensor-core body,
    compiled for sm_90 only, which must have them), and the split kernel reads K/V with
    128-bit loads (sm_90: cp.async into its pipeline's shared memory); the real compiler
    in a subprocess, no GPU needed."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 11
    for key, r in result.items():
        assert r["target"] and not r["bf16"] and r["mma"] == ("split-mma" in key), (key, r)
        assert r["gdc"] == key.startswith("sm90"), key  # compiled with PDL on for sm_90 only
        if "/split/" in key:
            assert r["vector_loads"], key
