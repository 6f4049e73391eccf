"""The KV side of one batched forward: where each row's K/V goes, and what it attends to.

A step's batch is a list of segments, one per request: a prefill chunk (n ≥ 1 tokens)
or a decode row (n = 1), at positions start..start+n-1 of that request. All index
tensors are built once per step and reused by every layer.

Reading: attention reads K/V where they lie in the pool, never concatenating a
request's pages into a new tensor (that copy made the original's paged decode 0.61×
contiguous on a T4). A block table is split into runs of consecutive pages — the pool
hands out consecutive pages when it can, so a request usually has one run or a few —
and each run is a plain slice of the flat pool. One run (always the case in
`contiguous` mode) goes to SDPA directly; several runs go to `causal_attention_runs`,
which joins only the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.cache.page_pool import PagePool
from minivllm.kernels.attention import causal_attention, causal_attention_runs


@dataclass(frozen=True)
class Segment:
    block_table: list[int]
    start: int  # position of the first token of this chunk
    n: int  # tokens in this chunk


class PagedBatchKV:
    def __init__(self, pool: PagePool, segments: list[Segment]):
        self.pool = pool
        self.segments = segments
        ps = pool.page_size
        device = pool.k.device
        write, self._reads, self._rows = [], [], []
        row = 0
        for seg in segments:
            end = seg.start + seg.n
            pos = torch.arange(seg.start, end)
            table = torch.tensor(seg.block_table, dtype=torch.long)
            write.append(table[pos // ps] * ps + pos % ps)
            self._reads.append(_runs(seg.block_table, ps, end))
            self._rows.append(slice(row, row + seg.n))
            row += seg.n
        self.n_rows = row
        self._write = torch.cat(write).to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v (rows, KVH, D) in the pool and attend; returns (rows, H, D)."""
        kf = self.pool.k[layer].view(-1, *self.pool.k.shape[-2:])
        vf = self.pool.v[layer].view(-1, *self.pool.v.shape[-2:])
        kf.index_copy_(0, self._write, k.to(kf.dtype))
        vf.index_copy_(0, self._write, v.to(vf.dtype))
        if len(self.segments) == 1:
            return self._one(q, kf, vf, 0)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for i in range(len(self.segments)):
            out[self._rows[i]] = self._one(q[self._rows[i]], kf, vf, i)
        return out

    def _one(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, i: int) -> torch.Tensor:
        runs = self._reads[i]
        if len(runs) == 1:
            return causal_attention(q, kf[runs[0]], vf[runs[0]], self.segments[i].start)
        return causal_attention_runs(q, [(kf[r], vf[r]) for r in runs], self.segments[i].start)


def _runs(block_table: list[int], page_size: int, n_tokens: int) -> list[slice]:
    """Slices of the flat pool that hold positions 0..n_tokens-1, one per run of
    consecutive pages."""
    runs: list[slice] = []
    pages = block_table[: -(-n_tokens // page_size)]
    first = prev = pages[0]
    for p in pages[1:] + [None]:
        if p is not None and p == prev + 1:
            prev = p
            continue
        runs.append(slice(first * page_size, (prev + 1) * page_size))
        if p is not None:
            first = prev = p
    last = runs[-1]
    runs[-1] = slice(last.start, last.stop - (len(pages) * page_size - n_tokens))
    return runs
