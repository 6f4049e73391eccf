"""CUDA graphs for prompt chunks: one captured forward per chunk-length bucket.

An eager forward is a few hundred kernel launches, and on the lent H100's host each
cost ~57 µs from Python (a 7B decode step ran 28 ms eager against 5 ms of GPU work). A
prompt's forward is the same launches with more rows: a 512-token prefill of Qwen2.5-0.5B
took ~23 ms, nearly all of it launching (scripts/profile_decode_step.py --prefill), where
llama.cpp's pp512 takes ~12 ms. Replaying a captured graph issues them at once.

A step with prompt chunks (one or several, decode rows beside them or not) runs the graph
of the smallest bucket (16, 32, ..., max_batched_tokens) that holds its rows:
- static inputs, as the decode graphs (engine/cuda_graphs.py): token ids, positions, KV
  write slots, each row's sequence and position, the block tables, the logits rows,
  packed into two pinned buffers and copied once each;
- padding rows (bucket > rows) belong to a sequence of their own in the scratch page:
  they write their K/V there and attend only to it;
- logits are computed for min(`max_rows`, bucket) rows every time (the step's logits rows,
  then row 0 again): one shape per bucket, a few LM-head rows more than needed;
- attention runs every row through the paged Triton kernel (the eager default-mode
  prefill uses SDPA over the pages' runs, which a graph cannot capture: the runs change
  per request). Both compute in float32; their sums differ only in order. In
  batch-invariant mode eager prefill uses the same kernel, so the graph is bit-identical.

Captured lazily per bucket, after one eager warm-up of the same shapes. `prefill_graphs=False`
or `enforce_eager=True` turns it off.
"""

from __future__ import annotations

from collections import Counter

import torch

from minivllm.cache.batch_kv import PagedBatchKV
from minivllm.cache.page_pool import PagePool
from minivllm.engine.cuda_graphs import BucketGraphs, capture_graph

_SMALLEST = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    out, b = [], _SMALLEST
    while b < max_tokens:
        out.append(b)
        b *= 2
    return out + [max_tokens]


class PrefillGraphRunner(BucketGraphs):
    label = "prefill graph"

    def __init__(self, model, pool: PagePool, *, scratch_page: int, max_tokens: int, max_rows: int,
                 max_model_len: int, options):
        self.model, self.pool, self.options = model, pool, options
        self.scratch_page = scratch_page
        self.buckets = prefill_buckets(max_tokens)
        n = self.max_tokens = self.buckets[-1]
        self.max_rows = max_rows  # segments (requests) per step, and logits rows per replay
        self.max_pages = -(-max_model_len // pool.page_size)
        device = model.device
        # int64 [token_ids | positions | write_slots (n each) | logits rows (max_rows)];
        # int32 [row_seq | row_pos (n each) | block tables (max_rows + 1 for the padding rows)]
        self._long = torch.zeros(3 * n + max_rows, dtype=torch.long, device=device)
        self._int = torch.zeros(2 * n + (max_rows + 1) * self.max_pages, dtype=torch.int32, device=device)
        self.token_ids, self.positions, self.write_slots = self._long[:3 * n].view(3, n).unbind(0)
        self.logit_rows = self._long[3 * n:]
        self.row_seq, self.row_pos = self._int[:2 * n].view(2, n).unbind(0)
        self.block_tables = self._int[2 * n:].view(max_rows + 1, self.max_pages)
        self._staging = [_Staging(self._long.numel(), self._int.numel()) for _ in range(2)]
        self._fills = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.path_counts: dict[int, Counter] = {}
        self.failed: dict[int, str] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.replays = 0

    def can_run(self, n_rows: int, n_segments: int, n_logits: int) -> bool:
        return (0 < n_rows <= self.max_tokens and n_segments <= self.max_rows and n_logits <= self.max_rows
                and self.bucket(n_rows) not in self.failed)

    def bucket(self, n_rows: int) -> int:
        return next(b for b in self.buckets if b >= n_rows)

    def _fill(self, chunks, logit_rows: list[int], bucket: int) -> None:
        staging = self._staging[self._fills % 2]
        self._fills += 1
        staging.ready.synchronize()  # its copies of two fills ago have been read
        pack_step(staging.longs, staging.ints, chunks, logit_rows, bucket=bucket, max_tokens=self.max_tokens,
                  max_rows=self.max_rows, max_pages=self.max_pages, page_size=self.pool.page_size,
                  scratch_page=self.scratch_page)
        self._long.copy_(staging.long_tensor, non_blocking=True)
        self._int.copy_(staging.int_tensor, non_blocking=True)
        staging.ready.record()

    def _forward(self, bucket: int) -> torch.Tensor:
        kv = PagedBatchKV.static_decode(self.pool, self.write_slots[:bucket], self.block_tables,
                                        self.row_seq[:bucket], self.row_pos[:bucket],
                                        invariant=self.options.batch_invariant)
        # A bucket of b rows has at most b logits rows to give: no more LM-head rows than that.
        return self.model.forward_batch(self.token_ids[:bucket], self.positions[:bucket], kv,
                                        self.logit_rows[:min(self.max_rows, bucket)], options=self.options)

    def _capture(self, bucket: int) -> None:
        forward = lambda: self._forward(bucket)  # noqa: E731
        graph, out, self.path_counts[bucket] = capture_graph(forward, forward, self.mempool, self.options.path_counts)
        self.graphs[bucket], self.outputs[bucket] = graph, out

    def run(self, chunks, logit_rows: list[int]) -> torch.Tensor | None:
        """Logits (len(logit_rows), vocab) float32 of the step's `chunks` (engine/step_inputs.Chunk),
        queued; None when this bucket cannot be captured (the caller runs the step eagerly)."""
        bucket = self.bucket(sum(len(c.token_ids) for c in chunks))
        self._fill(chunks, logit_rows, bucket)
        if not self.replay_bucket(bucket):
            return None
        return self.outputs[bucket][:len(logit_rows)]


def pack_step(longs, ints, chunks, logit_rows: list[int], *, bucket: int, max_tokens: int, max_rows: int,
              max_pages: int, page_size: int, scratch_page: int) -> None:
    """Write a step's graph inputs into the two host arrays (numpy views of the pinned
    buffers), in the layout of `PrefillGraphRunner`'s device buffers:
    longs = [token ids | positions | write slots] (max_tokens each) + [logits rows] (max_rows);
    ints = [row sequence | row position] (max_tokens each) + block tables (max_rows + 1 rows
    of max_pages, the last for the padding rows). Rows past `bucket` are left as they were."""
    n, ps, sp, pad_seq = max_tokens, page_size, scratch_page, max_rows
    tables = ints[2 * n:].reshape(pad_seq + 1, max_pages)
    tables[pad_seq] = sp
    t = 0
    for i, c in enumerate(chunks):
        k, table = len(c.token_ids), c.block_table
        pos = range(c.start, c.start + k)
        longs[t:t + k] = c.token_ids
        longs[n + t:n + t + k] = pos
        longs[2 * n + t:2 * n + t + k] = [table[p // ps] * ps + p % ps for p in pos]
        ints[t:t + k] = i
        ints[n + t:n + t + k] = pos
        tables[i, :len(table)] = table
        t += k
    longs[t:bucket] = 0  # padding rows: token 0 at position 0 of the scratch page
    longs[n + t:n + bucket] = 0
    longs[2 * n + t:2 * n + bucket] = sp * ps
    ints[t:bucket] = pad_seq
    ints[n + t:n + bucket] = 0
    longs[3 * n:3 * n + len(logit_rows)] = logit_rows
    longs[3 * n + len(logit_rows):] = 0


class _Staging:
    def __init__(self, longs: int, ints: int):
        self.long_tensor = torch.zeros(longs, dtype=torch.long, pin_memory=True)
        self.int_tensor = torch.zeros(ints, dtype=torch.int32, pin_memory=True)
        self.longs, self.ints = self.long_tensor.numpy(), self.int_tensor.numpy()
        self.ready = torch.cuda.Event()
        self.ready.record()
