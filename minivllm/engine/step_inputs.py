"""A forward's inputs, written into buffers that live as long as the runner.

A step's rows are Python data (token ids, positions, block tables); the model needs
tensors. Making new tensors from those lists every step (`torch.tensor(ids)`, one per
index the attention reads) costs an allocation each, and on a GPU a pageable copy each.
Here they go into persistent host buffers through their numpy views (as vLLM v1's
input batch does), and on a GPU into persistent device buffers by one copy each from
pinned memory. The buffers grow (doubling) when a step needs more rows; they never
shrink.

What the forward gets are views of the first n elements, valid until the next `fill`:
one fill per forward, and the runner reads the forward's results before the next one.
Overlapping the next step's fill with this step's forward (async scheduling) needs a
second set of buffers, flipped per step (ARCHITECTURE.md, "The step").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.cache.batch_kv import PagedBatchKV, Segment
from minivllm.cache.page_pool import PagePool

# name -> dtype: what PagedBatchKV and forward_batch read.
_FIELDS = {"ids": torch.long, "positions": torch.long, "write_slots": torch.long, "row_seq": torch.int32,
           "row_pos": torch.int32, "block_tables": torch.int32, "logit_rows": torch.long}


@dataclass
class Chunk:
    """One segment of a forward: `token_ids` at positions start.., K/V in `block_table`'s pages."""
    token_ids: list[int]
    start: int
    block_table: list[int]


@dataclass
class ForwardInputs:
    token_ids: torch.Tensor
    positions: torch.Tensor
    kv: PagedBatchKV
    logit_rows: torch.Tensor
    segments: list[Segment]


class StepInputs:
    def __init__(self, pool: PagePool, *, tokens: int, rows: int, invariant: bool):
        self.pool = pool
        self.invariant = invariant
        self.device = pool.k.device
        self._pinned = self.device.type == "cuda" and torch.cuda.is_available()
        self._sizes = {name: 0 for name in _FIELDS}
        self._host: dict[str, torch.Tensor] = {}
        self._numpy: dict = {}
        self._dev: dict[str, torch.Tensor] = {}
        # Set once the last fill's copies are queued: the next fill overwrites the pinned
        # buffers only after they have been read (a step of forced tokens never syncs).
        self._copied = torch.cuda.Event() if self._pinned else None
        self._reserve({"ids": tokens, "positions": tokens, "write_slots": tokens, "row_seq": tokens,
                       "row_pos": tokens, "block_tables": rows * 8, "logit_rows": tokens})

    def _reserve(self, wanted: dict[str, int]) -> None:
        for name, n in wanted.items():
            if n <= self._sizes[name]:
                continue
            size = max(n, 2 * self._sizes[name])
            self._host[name] = torch.zeros(size, dtype=_FIELDS[name], pin_memory=self._pinned)
            self._numpy[name] = self._host[name].numpy()
            if self.device.type != "cpu":
                self._dev[name] = torch.zeros(size, dtype=_FIELDS[name], device=self.device)
            self._sizes[name] = size

    def _view(self, name: str, values: list[int]) -> torch.Tensor:
        """The first len(values) elements of buffer `name`, holding `values`, on the device."""
        n = len(values)
        self._numpy[name][:n] = values
        host = self._host[name][:n]
        if self.device.type == "cpu":
            return host
        dev = self._dev[name][:n]
        dev.copy_(host, non_blocking=True)
        return dev

    def fill(self, chunks: list[Chunk], logit_rows: list[int]) -> ForwardInputs:
        """The forward's tensors for `chunks`, logits at `logit_rows` (indices into the
        flattened rows): views of the buffers, valid until the next fill."""
        if self._copied is not None:
            self._copied.synchronize()
        ps = self.pool.page_size
        width = max(len(c.block_table) for c in chunks)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        row_seq: list[int] = []
        tables: list[int] = []
        segments = []
        for i, c in enumerate(chunks):
            n, table = len(c.token_ids), c.block_table
            span = range(c.start, c.start + n)
            ids += c.token_ids
            positions += span
            slots += [table[p // ps] * ps + p % ps for p in span]
            row_seq += [i] * n
            # Padded with page 0: a row reads only pages up to its position.
            tables += table
            tables += [0] * (width - len(table))
            segments.append(Segment(list(table), c.start, n))
        t = len(ids)
        self._reserve({"ids": t, "positions": t, "write_slots": t, "row_seq": t, "row_pos": t,
                       "block_tables": len(tables), "logit_rows": len(logit_rows)})
        index = (self._view("write_slots", slots), self._view("block_tables", tables).view(len(chunks), width),
                 self._view("row_seq", row_seq), self._view("row_pos", positions))
        kv = PagedBatchKV(self.pool, segments, invariant=self.invariant, index=index)
        inputs = ForwardInputs(self._view("ids", ids), self._view("positions", positions), kv,
                               self._view("logit_rows", logit_rows), segments)
        if self._copied is not None:
            self._copied.record()
        return inputs
