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
one eager warm-up run of the same shapes, which compiles the Triton kernels).
`enforce_eager=True` turns the whole thing off.

The greedy draw is part of the graph: it ends with each row's argmax, written into the
token-id buffer itself, and a replay queues a copy of those tokens into pinned host
memory. So a decode step whose rows all continue can be replayed again before the host
has read the tokens (engine/step_pipeline.py): the next replay reads its input tokens
where the last one left them. A sampled row's device draw replaces its argmax there
(`GraphStep.replace`). Rows that mask, penalise or report logprobs draw from the logits
outside the graph, as before; the argmax they do not use costs one small kernel.

Inputs travel in two host-to-device copies per step (one int64 and one int32 buffer,
packed from pinned host memory through numpy), not one per tensor: on a slow host each
copy from a fresh tensor cost tens of microseconds.
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


class BucketGraphs:
    """Graphs captured lazily, one per bucket: `replay_bucket` captures on first use (a
    failure is remembered, and that bucket runs eagerly from then on), replays, and
    reports the captured kernel paths as this step's. Subclasses set `graphs`, `failed`,
    `path_counts`, `options`, `replays`, `label` and define `_capture(bucket)`."""

    label = "graph"

    def replay_bucket(self, bucket: int) -> bool:
        if bucket not in self.graphs:
            try:
                self._capture(bucket)
            except Exception as exc:  # noqa: BLE001 — a capture failure costs speed, not the requests
                self.failed[bucket] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
                return False
        self.graphs[bucket].replay()
        self.replays += 1
        counts = self.options.path_counts
        counts.clear()
        counts.update({f"{path} ({self.label})": n for path, n in self.path_counts[bucket].items()})
        return True


class DecodeGraphRunner(BucketGraphs):
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
        self.max_rows = n
        # Device inputs: views of two packed buffers (one copy each per step), laid out as
        # [token_ids | positions | write_slots] (int64) and [row_pos | block_tables] (int32).
        self._long = torch.zeros(3 * n, dtype=torch.long, device=device)
        self._int = torch.zeros(n + n * self.max_pages, dtype=torch.int32, device=device)
        self.token_ids, self.positions, self.write_slots = self._long.view(3, n).unbind(0)
        self.row_pos = self._int[:n]
        self.block_tables = self._int[n:].view(n, self.max_pages)
        self.row_seq = torch.arange(n, dtype=torch.int32, device=device)
        self._staging = [_PinnedInputs(n, self.max_pages) for _ in range(2)]  # flipped per fill
        self._fills = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.tokens: dict[int, torch.Tensor] = {}  # bucket -> the graph's argmax per row (int64)
        self._read_back = [_PinnedTokens(n) for _ in range(2)]  # the drawn tokens, per replay
        self._replays_queued = 0
        self.path_counts: dict[int, Counter] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.replays = 0
        self.failed: dict[int, str] = {}  # bucket -> why its capture failed (it then runs eagerly)

    def can_run(self, segments: list[Segment]) -> bool:
        return (0 < len(segments) <= self.buckets[-1] and all(s.n == 1 for s in segments)
                and self.bucket(len(segments)) not in self.failed)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _fill(self, token_ids: list[int] | None, segments: list[Segment], bucket: int) -> None:
        """Write the step's inputs into the graph's buffers: `token_ids` None keeps the
        tokens the last replay drew (a pipelined step, same rows in the same order).
        Padding rows: token 0 at position 0 in the scratch page."""
        staging = self._staging[self._fills % 2]
        self._fills += 1
        staging.ready.synchronize()  # its last copies (two fills ago) have been read
        n = self.max_rows
        pack_decode(staging.longs, staging.ints, token_ids, segments, bucket=bucket, max_rows=n,
                    max_pages=self.max_pages, page_size=self.pool.page_size, scratch_page=self.scratch_page)
        # Contiguous ranges only (a strided copy would stage through pageable memory); rows
        # past the bucket carry stale values no graph of this bucket reads.
        first = 0 if token_ids is not None else n  # None: keep the token ids the last replay drew
        self._long[first:].copy_(staging.long_tensor[first:], non_blocking=True)
        used = n + bucket * self.max_pages
        self._int[:used].copy_(staging.int_tensor[:used], non_blocking=True)
        staging.ready.record()

    def _forward(self, bucket: int) -> torch.Tensor:
        kv = PagedBatchKV.static_decode(self.pool, self.write_slots[:bucket], self.block_tables[:bucket],
                                        self.row_seq[:bucket], self.row_pos[:bucket], invariant=self.invariant)
        return self.model.forward_batch(self.token_ids[:bucket], self.positions[:bucket], kv, None,
                                        options=self.options)

    def _capture(self, bucket: int) -> None:
        def body():
            out = self._forward(bucket)
            tokens = out.argmax(dim=-1)  # the greedy draw: the first maximum, as torch.argmax anywhere
            self.token_ids[:bucket].copy_(tokens)  # the next replay's input, if the rows stay
            return out, tokens

        graph, (out, tokens), self.path_counts[bucket] = capture_graph(lambda: self._forward(bucket), body,
                                                                       self.mempool, self.options.path_counts)
        self.graphs[bucket], self.outputs[bucket], self.tokens[bucket] = graph, out, tokens

    def run(self, token_ids: list[int] | None, segments: list[Segment]) -> "GraphStep | None":
        """Replay the bucket's graph for a decode-only step: its logits (B, vocab) float32
        and its drawn tokens (read with `GraphStep.tokens`), or None when this bucket
        cannot be captured (the caller then runs the step eagerly). `token_ids` None: the
        rows are the last replay's, in its order, and take the tokens it drew."""
        bucket = self.bucket(len(segments))
        if token_ids is None and bucket not in self.graphs:
            raise RuntimeError("a pipelined step needs the previous replay of its bucket")
        self._fill(token_ids, segments, bucket)
        if not self.replay_bucket(bucket):
            return None
        # The drawn tokens go to pinned memory now, queued behind the replay, so the host
        # can read them after the next step is already queued.
        back = self._read_back[self._replays_queued % 2]
        self._replays_queued += 1
        back.ready.synchronize()  # its previous copy (two replays ago) has been read
        rows = len(segments)
        back.tokens[:rows].copy_(self.tokens[bucket][:rows], non_blocking=True)
        back.ready.record()
        return GraphStep(self.outputs[bucket][:rows], back, rows, self.token_ids)


def capture_graph(warm_up, body, mempool, counts: Counter):
    """Run `warm_up()` once eagerly on a side stream (Triton compilation, autotuning,
    cuBLAS workspaces happen there), then capture `body()` into a new graph. Returns the
    graph, what `body` returned (the graph's static outputs) and the kernel path counts
    its Python dispatch recorded: it runs once, so they are kept to report on every replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm_up()
    torch.cuda.current_stream().wait_stream(stream)
    counts.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        out = body()
    return graph, out, Counter(counts)


def pack_decode(longs, ints, token_ids: list[int] | None, segments: list[Segment], *, bucket: int, max_rows: int,
                max_pages: int, page_size: int, scratch_page: int) -> None:
    """A decode step's graph inputs in the two host arrays (numpy views of the pinned
    buffers): longs = [token ids | positions | write slots] (max_rows each), ints =
    [row positions (max_rows) | block tables (max_rows x max_pages)]. Rows b..bucket are
    padding: token 0 at position 0 in the scratch page. `token_ids` None leaves the ids."""
    b, ps, n = len(segments), page_size, max_rows
    pos = [s.start for s in segments]
    longs[n:n + b] = pos
    longs[n + b:n + bucket] = 0
    longs[2 * n:2 * n + b] = [s.block_table[p // ps] * ps + p % ps for s, p in zip(segments, pos)]
    longs[2 * n + b:2 * n + bucket] = scratch_page * ps
    ints[:b] = pos
    ints[b:bucket] = 0
    tables = ints[n:n + bucket * max_pages].reshape(bucket, max_pages)
    tables[:] = scratch_page
    for i, s in enumerate(segments):
        tables[i, :len(s.block_table)] = s.block_table
    if token_ids is not None:
        longs[:b] = token_ids
        longs[b:bucket] = 0


class GraphStep:
    """A queued replay: `logits` (valid until the next replay) and each row's token: the
    graph's argmax, or what `replace` put there (a draw made on the device)."""

    def __init__(self, logits: torch.Tensor, back: "_PinnedTokens", rows: int, next_inputs: torch.Tensor):
        self.logits = logits
        self._back = back
        self.rows = rows
        self._next_inputs = next_inputs  # the token-id buffer the next replay reads
        self._generation = back.generation = back.generation + 1

    def replace(self, row: int, token: torch.Tensor) -> None:
        """Row `row` takes `token` (a (1,) int64 device tensor) instead of its argmax: for
        the next replay and for `tokens`. Queued on the stream; nothing waits."""
        self._next_inputs[row:row + 1].copy_(token)
        self._back.tokens[row:row + 1].copy_(token, non_blocking=True)
        self._back.ready.record()

    def tokens(self) -> list[int]:
        """Each row's token, once the replay (and any `replace`) has run: waits for that,
        not for later work."""
        if self._back.generation != self._generation:
            raise RuntimeError("tokens read after their buffer was reused (two replays later)")
        self._back.ready.synchronize()
        return self._back.tokens[:self.rows].tolist()


class _PinnedInputs:
    """Host staging of one fill: int64 [ids | positions | slots], int32 [row_pos | tables]."""

    def __init__(self, rows: int, max_pages: int):
        self.long_tensor = torch.zeros(3 * rows, dtype=torch.long, pin_memory=True)
        self.int_tensor = torch.zeros(rows + rows * max_pages, dtype=torch.int32, pin_memory=True)
        self.longs, self.ints = self.long_tensor.numpy(), self.int_tensor.numpy()
        self.ready = torch.cuda.Event()
        self.ready.record()


class _PinnedTokens:
    def __init__(self, rows: int):
        self.tokens = torch.zeros(rows, dtype=torch.long, pin_memory=True)
        self.ready = torch.cuda.Event()
        self.ready.record()
        self.generation = 0
