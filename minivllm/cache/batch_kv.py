"""The KV side of one batched forward: where each row's K/V goes, and what it attends to.

A step's batch is a list of segments, one per request: a prefill chunk (n ≥ 1 tokens)
or a decode row (n = 1), at positions start..start+n-1 of that request. All index
tensors are built once per step and reused by every layer.

Reading: a request whose block table is a single page (the `contiguous` mode, where a
page holds a whole sequence) attends to a plain slice of that page — no copy. A request
spread over several pages attends to one vectorised gather of its slots from the flat
pool (a single index_select per layer, never a per-page concatenation, which is what
made the original's paged decode 0.61× contiguous). The Triton paged-decode kernel of
the kernels issue reads pages without that gather on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.cache.page_pool import PagePool
from minivllm.kernels.attention import causal_attention


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
            if len(seg.block_table) == 1:
                first = seg.block_table[0] * ps
                self._reads.append(slice(first, first + end))
            else:
                allpos = torch.arange(end)
                self._reads.append((table[allpos // ps] * ps + allpos % ps).to(device))
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
        read = self._reads[i]
        keys, values = (kf[read], vf[read]) if isinstance(read, slice) else (kf.index_select(0, read), vf.index_select(0, read))
        return causal_attention(q, keys, values, self.segments[i].start)
