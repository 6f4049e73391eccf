"""The CUDA graphs' input packing (prefill_graphs.pack_step, cuda_graphs.pack_decode), row by row
against the attention contract: each row's pool slot is its page's first slot plus its
offset in the page, padding rows live in the scratch page, logits rows pad with row 0.
CPU only: CI has no GPU, and the CUDA tests cover the replay itself."""

from __future__ import annotations

import numpy as np

from minivllm.engine.prefill_graphs import pack_step, prefill_buckets
from minivllm.engine.step_inputs import Chunk

N, ROWS, PAGES, PS, SCRATCH = 64, 4, 6, 16, 99


def packed(chunks, logit_rows, bucket):
    longs = np.full(3 * N + ROWS, -7, dtype=np.int64)
    ints = np.full(2 * N + (ROWS + 1) * PAGES, -7, dtype=np.int32)
    pack_step(longs, ints, chunks, logit_rows, bucket=bucket, max_tokens=N, max_rows=ROWS, max_pages=PAGES,
              page_size=PS, scratch_page=SCRATCH)
    return longs, ints


def test_two_chunks_and_a_decode_row():
    chunks = [Chunk(list(range(100, 120)), 0, [5, 2]),  # a prompt's first 20 tokens: pages 5 then 2
              Chunk([7], 33, [1, 3, 8]),  # a decode row at position 33: page 8, offset 1
              Chunk([11, 12, 13], 14, [4, 6])]  # a chunk crossing from page 4 into page 6
    longs, ints = packed(chunks, [19, 20, 23], bucket=32)
    ids, pos, slots = longs[:N], longs[N:2 * N], longs[2 * N:3 * N]
    seq, rpos = ints[:N], ints[N:2 * N]
    tables = ints[2 * N:].reshape(ROWS + 1, PAGES)
    assert list(ids[:24]) == list(range(100, 120)) + [7, 11, 12, 13]
    assert list(pos[:24]) == list(range(20)) + [33, 14, 15, 16]
    assert list(rpos[:24]) == list(pos[:24])
    want_slots = [5 * 16 + p for p in range(16)] + [2 * 16 + p for p in range(4)] + [8 * 16 + 1] + \
        [4 * 16 + 14, 4 * 16 + 15, 6 * 16 + 0]
    assert list(slots[:24]) == want_slots
    assert list(seq[:24]) == [0] * 20 + [1] + [2] * 3
    assert list(tables[0, :2]) == [5, 2] and list(tables[1, :3]) == [1, 3, 8] and list(tables[2, :2]) == [4, 6]
    # padding rows 24..31: token 0, position 0, the scratch page's first slot, the padding sequence
    assert set(ids[24:32]) == {0} and set(pos[24:32]) == {0} and set(slots[24:32]) == {SCRATCH * PS}
    assert set(seq[24:32]) == {ROWS} and set(rpos[24:32]) == {0} and set(tables[ROWS]) == {SCRATCH}
    assert list(longs[3 * N:]) == [19, 20, 23, 0]  # logits rows, padded with row 0
    assert set(ids[32:]) == {-7}  # past the bucket: untouched


def test_buckets_double_up_to_the_step_budget():
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]


def test_decode_rows_and_their_padding():
    from minivllm.cache.batch_kv import Segment
    from minivllm.engine.cuda_graphs import pack_decode

    rows, pages = 8, 5
    longs = np.full(3 * rows, -7, dtype=np.int64)
    ints = np.full(rows + rows * pages, -7, dtype=np.int32)
    segs = [Segment([3, 9], 20, 1), Segment([4], 0, 1), Segment([1, 2, 6], 47, 1)]
    pack_decode(longs, ints, [5, 6, 7], segs, bucket=4, max_rows=rows, max_pages=pages, page_size=PS,
                scratch_page=SCRATCH)
    assert list(longs[:4]) == [5, 6, 7, 0]
    assert list(longs[rows:rows + 4]) == [20, 0, 47, 0]
    assert list(longs[2 * rows:2 * rows + 4]) == [9 * 16 + 4, 4 * 16, 6 * 16 + 15, SCRATCH * 16]
    assert list(ints[:4]) == [20, 0, 47, 0]
    tables = ints[rows:rows + 4 * pages].reshape(4, pages)
    assert tables.tolist() == [[3, 9] + [SCRATCH] * 3, [4] + [SCRATCH] * 4, [1, 2, 6, SCRATCH, SCRATCH],
                               [SCRATCH] * 5]
    assert set(ints[rows + 4 * pages:]) == {-7}
    before = longs[:rows].copy()
    pack_decode(longs, ints, None, segs, bucket=4, max_rows=rows, max_pages=pages, page_size=PS,
                scratch_page=SCRATCH)
    assert (longs[:rows] == before).all()  # a pipelined step keeps the ids the last replay drew
