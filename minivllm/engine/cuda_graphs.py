"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode step of a small model is hundreds of short kernel launches (30 layers x
norms, 7 projections, RoPE, attention, ...), and at batch 1 the CPU issuing them is
the bottleneck: the H200 waited on Python for ~25 ms per step. Replaying a captured
graph issues them all at once.

What a graph needs, and how it gets it:
- static inputs: token ids, positions, KV write slots, block tables, each row's
  sequence index and position live in buffers allocated once; a step copies its values
  into the first B rows and replays the graph of the smallest bucket >= B;
- padding rows (bucket > B) write their K/V into one page reserved for them and attend
  only to it, so they never touch a request's pages;
- attention reads pages through the Triton kernel, whose metadata are those buffers
  (block tables padded to the longest possible sequence);
- nothing in the captured forward synchronises with the host.

Graphs are captured lazily, per bucket, the first time a step of that size runs (after
one eager warm-up run of the same shapes, which compiles the Triton kernels). Sampling
stays outside the graph. `enforce_eager=True` turns the whole thing off.
"""

from __future__ import annotations

from collections import Counter

import torch

from minivllm.cache.batch_kv import PagedBatchKV, Segment, triton_paged_attention
from minivllm.cache.page_pool import PagePool


def buckets_for(max_rows: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_rows (vLLM's spacing, trimmed)."""
    out = [b for b in (1, 2, 4) if b < max_rows]
    b = 8
    while b < max_rows:
        out.append(b)
        b += 8
    return out + [max_rows]


def decode_graph_runner(model, pool: PagePool, *, max_rows: int, max_model_len: int,
                        options) -> "DecodeGraphRunner | None":
    """A graph runner for decode steps of `model` over `pool` under the kernel `options`
    (captured into the graphs), or None where graphs cannot run (not CUDA, no Triton
    kernel for this cache dtype, no room for the scratch page): steps are then eager. The
    model runner makes one for the target and one for the draft."""
    if model.device.type != "cuda" or pool.num_pages < 2 or triton_paged_attention(pool, False) is None:
        return None
    return DecodeGraphRunner(model, pool, max_rows=max_rows, max_model_len=max_model_len, options=options)


class DecodeGraphRunner:
    def __init__(self, model, pool: PagePool, *, max_rows: int, max_model_len: int, options):
        self.model = model
        self.pool = pool
        self.options = options
        self.invariant = options.batch_invariant
        self.buckets = buckets_for(max_rows)
        device = model.device
        self.max_pages = -(-max_model_len // pool.page_size)
        # The padding rows' page: taken from the pool for the engine's lifetime.
        self.scratch_page = pool.allocate(1)[0]
        n = self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.token_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.write_slots = torch.full((n,), self.scratch_page * pool.page_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, self.max_pages), self.scratch_page, **i32)
        self.row_seq = torch.arange(n, **i32)
        self.row_pos = torch.zeros(n, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.path_counts: dict[int, Counter] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.failed: dict[int, str] = {}  # bucket -> why its capture failed (it then runs eagerly)

    def can_run(self, segments: list[Segment]) -> bool:
        return (0 < len(segments) <= self.buckets[-1] and all(s.n == 1 for s in segments)
                and self.bucket(len(segments)) not in self.failed)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _fill(self, token_ids: list[int], segments: list[Segment], bucket: int) -> None:
        b, ps, device = len(segments), self.pool.page_size, self.model.device
        pos = [s.start for s in segments]
        tables = torch.full((bucket, self.max_pages), self.scratch_page, dtype=torch.int32)
        for i, s in enumerate(segments):
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        slots = [s.block_table[p // ps] * ps + p % ps for s, p in zip(segments, pos)]
        pad = bucket - b
        # One host-to-device copy per buffer; padding rows: token 0 at position 0 in the
        # scratch page.
        self.token_ids[:bucket].copy_(torch.tensor(token_ids + [0] * pad), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(pos + [0] * pad), non_blocking=True)
        self.row_pos[:bucket].copy_(torch.tensor(pos + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.write_slots[:bucket].copy_(torch.tensor(slots + [self.scratch_page * ps] * pad), non_blocking=True)
        self.block_tables[:bucket].copy_(tables.to(device, non_blocking=True))

    def _forward(self, bucket: int) -> torch.Tensor:
        kv = PagedBatchKV.static_decode(self.pool, self.write_slots[:bucket], self.block_tables[:bucket],
                                        self.row_seq[:bucket], self.row_pos[:bucket], invariant=self.invariant)
        return self.model.forward_batch(self.token_ids[:bucket], self.positions[:bucket], kv, None,
                                        options=self.options)

    def _capture(self, bucket: int) -> None:
        counts = self.options.path_counts
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bucket)  # warm-up: Triton compilation and autotuning happen here
        torch.cuda.current_stream().wait_stream(stream)
        counts.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._forward(bucket)
        # The Python dispatch ran once, during capture: keep its path counts to report
        # them on every replay.
        self.path_counts[bucket] = Counter(counts)
        self.graphs[bucket], self.outputs[bucket] = graph, out

    def run(self, token_ids: list[int], segments: list[Segment]) -> torch.Tensor | None:
        """Logits (B, vocab) float32 for a decode-only step through the bucket's graph, or
        None when this bucket cannot be captured (the caller then runs the step eagerly)."""
        bucket = self.bucket(len(segments))
        self._fill(token_ids, segments, bucket)
        if bucket not in self.graphs:
            try:
                self._capture(bucket)
            except Exception as exc:  # noqa: BLE001 — a capture failure costs speed, not the requests
                self.failed[bucket] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
                return None
        self.graphs[bucket].replay()
        self.replays += 1
        counts = self.options.path_counts
        counts.clear()
        counts.update({f"{path} (graph)": n for path, n in self.path_counts[bucket].items()})
        return self.outputs[bucket][:len(segments)]
