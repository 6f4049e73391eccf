"""The KV side of one batched forward: where each row's K/V goes, and what it attends to.

A step's batch is a list of segments, one per request: a prefill chunk (n ≥ 1 tokens)
or a decode row (n = 1), at positions start..start+n-1 of that request. All index
tensors are built once per step and reused by every layer.

Reading: attention reads K/V where they lie in the pool, never concatenating a
request's pages into a new tensor (a gather copy per step costs a paged decode about
40% of its speed on a T4: 0.61× contiguous).

- On CUDA, a step's K and V are stored with one Triton launch (`kv_store.py`), or by
  the fused RoPE kernel itself through `store_target`/`attend_stored`; on CPU with two
  `index_copy_`. Decode rows (segments with n == 1) go to the Triton `paged_attention`
  kernel, which follows each row's block table page by page. Its metadata
  (`block_tables`, `row_seq`, `row_pos`, and `write_slots` for storing K/V) are device
  tensors built once here, so a CUDA-graph runner can supply the same tensors from
  static buffers and refill them in place.
- Prefill chunks (n > 1), and everything on CPU, use SDPA: a block table is split into
  runs of consecutive pages — the pool hands out consecutive pages when it can, so a
  request usually has one run or a few — and each run is a plain slice of the flat
  pool. One run (always the case in `contiguous` mode) goes to SDPA directly; several
  runs are gathered into one key tensor first (a CPU decode row reads them through
  their slots in the compiled kernel instead, where it is built).
- `invariant=True` sends every row through a path whose result depends only on that
  row's own keys, so a token's output never depends on how its prompt was chunked or
  what else is batched with it: the Triton kernel on CUDA, and on CPU one
  `causal_attention` call per query row over keys 0..pos (slower; for checking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.cache.page_pool import PagePool
from minivllm.errors import DeviceError
from minivllm.kernels.attention import causal_attention


@dataclass(frozen=True)
class Segment:
    block_table: list[int]
    start: int  # position of the first token of this chunk
    n: int  # tokens in this chunk


class PagedBatchKV:
    """One step's KV bookkeeping. On CUDA, a decode-only step reads only
    `write_slots`, `block_tables`, `row_seq` and `row_pos` in `attend`, so a CUDA-graph
    runner may replace them with static buffers holding the same values (block tables
    padded to any width)."""

    def __init__(self, pool: PagePool, segments: list[Segment], *, invariant: bool = False,
                 index: tuple[torch.Tensor, ...] | None = None):
        """`index`: (write_slots, block_tables, row_seq, row_pos) already on the pool's
        device, with the values described below (the model runner fills them into
        persistent buffers, engine/step_inputs.py); built here from `segments` if None."""
        self.pool = pool
        self.segments = segments
        self.invariant = invariant
        ps = pool.page_size
        device = pool.k.device
        write, self._reads, self._rows = [], [], []
        self._slots: dict[int, torch.Tensor] = {}  # CPU decode rows over several runs: their pool slots
        row_seq, row_pos = [], []
        row = 0
        for i, seg in enumerate(segments):
            end = seg.start + seg.n
            if index is None:
                pos = torch.arange(seg.start, end)
                table = torch.tensor(seg.block_table, dtype=torch.long)
                write.append(table[pos // ps] * ps + pos % ps)
                row_seq += [i] * seg.n
                row_pos += range(seg.start, end)
            self._reads.append(_runs(seg.block_table, ps, end))
            self._rows.append(slice(row, row + seg.n))
            row += seg.n
        self.n_rows = row
        if index is not None:
            self.write_slots, self.block_tables, self.row_seq, self.row_pos = index
        else:
            self.write_slots = torch.cat(write).to(device)  # flat pool slot of each row's K/V
            # Paged-attention metadata (int32, on the pool's device): each segment's block
            # table padded with page 0 (never read: a row reads only pages up to its
            # position), and each row's segment and absolute position.
            width = max((len(seg.block_table) for seg in segments), default=1)
            self.block_tables = torch.tensor(
                [seg.block_table + [0] * (width - len(seg.block_table)) for seg in segments],
                dtype=torch.int32).to(device)
            self.row_seq = torch.tensor(row_seq, dtype=torch.int32).to(device)
            self.row_pos = torch.tensor(row_pos, dtype=torch.int32).to(device)
        self._paged_attention = triton_paged_attention(pool, invariant)
        self._triton_store = triton_store(pool, self._paged_attention)
        # Rows the kernel handles in a mixed step (decode rows), when not all rows are.
        self._kernel_rows = None
        self._all_rows_in_kernel = self._paged_attention is not None and (
            invariant or all(seg.n == 1 for seg in segments))
        if self._paged_attention is not None and not self._all_rows_in_kernel:
            decode = [self._rows[i].start for i, seg in enumerate(segments) if seg.n == 1]
            if decode:
                self._kernel_rows = torch.tensor(decode, dtype=torch.long).to(device)
                self._kernel_seq = self.row_seq[self._kernel_rows]
                self._kernel_pos = self.row_pos[self._kernel_rows]

    @classmethod
    def static_decode(cls, pool: PagePool, write_slots: torch.Tensor, block_tables: torch.Tensor,
                      row_seq: torch.Tensor, row_pos: torch.Tensor, *, invariant: bool = False) -> "PagedBatchKV":
        """A decode-only step over caller-owned device tensors (one row per sequence),
        for CUDA-graph capture: the graph records these tensors' addresses, and the
        runner refills them in place before every replay."""
        attention = triton_paged_attention(pool, invariant)
        if attention is None:
            raise DeviceError(f"captured decode steps need the Triton paged-attention kernel on {pool.k.device}; "
                              f"run with enforce_eager=True")
        self = cls.__new__(cls)
        self.pool, self.invariant = pool, invariant
        self.segments = []
        self._slots = {}
        self.n_rows = write_slots.shape[0]
        self.write_slots, self.block_tables, self.row_seq, self.row_pos = write_slots, block_tables, row_seq, row_pos
        self._paged_attention = attention
        self._triton_store = triton_store(pool, attention)
        self._all_rows_in_kernel = True
        self._kernel_rows = None
        return self

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store this step's k/v (rows, KVH, D) in the pool and attend; returns (rows, H, D)."""
        kf, vf = self._flat(layer)
        if self._triton_store is not None:  # both in one launch
            self._triton_store(k, v, kf, vf, self.write_slots)
        else:
            kf.index_copy_(0, self.write_slots, k.to(kf.dtype))
            vf.index_copy_(0, self.write_slots, v.to(vf.dtype))
        return self.attend_stored(layer, q)

    def store_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(k_cache, v_cache, write_slots): where a Triton kernel that holds this step's
        keys (fused RoPE) may store K and V itself, the same values `attend` would
        store, and then call `attend_stored`. None where only torch writes (CPU)."""
        return (*self._flat(layer), self.write_slots) if self._triton_store is not None else None

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attend with this step's K/V already in the pool (see `store_target`)."""
        kf, vf = self._flat(layer)
        if self._all_rows_in_kernel:
            return self._paged_attention(q, self.pool.k[layer], self.pool.v[layer], self.block_tables,
                                         self.row_seq, self.row_pos)
        if self.invariant:  # CPU: one query row at a time over exactly its own keys
            return self._per_row(q, kf, vf)
        if len(self.segments) == 1:
            return self._one(q, kf, vf, 0)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for i, seg in enumerate(self.segments):
            if seg.n == 1 and self._kernel_rows is not None:
                continue  # decode rows: filled by one kernel launch below
            out[self._rows[i]] = self._one(q[self._rows[i]], kf, vf, i)
        if self._kernel_rows is not None:
            out[self._kernel_rows] = self._paged_attention(
                q[self._kernel_rows], self.pool.k[layer], self.pool.v[layer], self.block_tables,
                self._kernel_seq, self._kernel_pos)
        return out

    def _flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V pages as flat (slots, KVH, D) views of the pool."""
        return (self.pool.k[layer].view(-1, *self.pool.k.shape[-2:]),
                self.pool.v[layer].view(-1, *self.pool.v.shape[-2:]))

    def _per_row(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor) -> torch.Tensor:
        """Each query row alone over keys 0..pos: its result depends only on its own keys,
        never on the chunk it came in nor on where its pages sit in the pool. Every row
        reads one contiguous key tensor (the segment's pages joined once when they are
        not consecutive): summing over runs instead would change the order with the page
        layout, and a request whose first pages come from the prefix cache almost never
        has one run."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        ps = self.pool.page_size
        for i, seg in enumerate(self.segments):
            runs = _runs(seg.block_table, ps, seg.start + seg.n)
            k = kf[runs[0]] if len(runs) == 1 else torch.cat([kf[r] for r in runs])
            v = vf[runs[0]] if len(runs) == 1 else torch.cat([vf[r] for r in runs])
            for j in range(seg.n):
                pos = seg.start + j
                row = self._rows[i].start + j
                out[row] = causal_attention(q[row:row + 1], k[:pos + 1], v[:pos + 1], pos)[0]
        return out

    def _one(self, q: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, i: int) -> torch.Tensor:
        runs = self._reads[i]
        if len(runs) == 1:
            return causal_attention(q, kf[runs[0]], vf[runs[0]], self.segments[i].start)
        if self.segments[i].n == 1 and kf.device.type == "cpu":
            # A decode row over pages that are not consecutive: the compiled kernel reads
            # them through their slots with the one-run kernel's arithmetic, so where the
            # pages lie changes neither the speed nor the bits.
            from minivllm.kernels.cpu_gemv import attend_decode_slots

            slots = self._slots.get(i)
            if slots is None:
                slots = self._slots[i] = torch.cat([torch.arange(r.start, r.stop) for r in runs])
            out = attend_decode_slots(q, kf, vf, slots)
            if out is not None:
                return out
        # The runs' keys gathered once, then the one-run path: attending run by run would be
        # two small matmuls a page per layer (a 4096-token context in 16-token pages: 512
        # a layer), 12-85x slower than the gather on two cores; a decode row then also
        # gets the bits it would get over consecutive pages.
        slots = self._slots.get(i)
        if slots is None:
            slots = self._slots[i] = torch.cat([torch.arange(r.start, r.stop, device=kf.device) for r in runs])
        return causal_attention(q, kf.index_select(0, slots), vf.index_select(0, slots), self.segments[i].start)


def triton_paged_attention(pool: PagePool, invariant: bool):
    """The Triton kernel when this pool's device can run it, else None (SDPA path).

    Imported lazily: CPU users need not have Triton installed, and importing the kernel
    module on CPU would fix Triton's interpreter setting before tests choose it."""
    device = pool.k.device
    if device.type != "cuda":
        return None
    from minivllm.kernels.gpu_profile import gpu_profile

    if pool.k.dtype == torch.bfloat16 and not gpu_profile(device).bf16 and not invariant:
        return None  # Triton cannot load bf16 below sm_80; the invariant path lets the kernel say so
    try:
        from minivllm.kernels.triton.paged_attention import paged_attention
    except ImportError as exc:
        if invariant:
            raise DeviceError(f"invariant attention on {device} needs Triton ({exc}); install triton "
                              f"(it ships with torch's CUDA wheels) or drop invariant mode") from exc
        return None
    return paged_attention


def triton_store(pool: PagePool, attention):
    """The Triton one-launch K/V store where the Triton attention runs and Triton can
    write the cache's dtype, else None (torch's index_copy_). Below sm_80 a bf16 cache is
    left to the attention kernel, which refuses it in invariant mode with a clear error.
    Imported lazily, as the attention kernel."""
    if attention is None:
        return None
    from minivllm.kernels.gpu_profile import gpu_profile

    if pool.k.dtype == torch.bfloat16 and not gpu_profile(pool.k.device).bf16:
        return None
    from minivllm.kernels.triton.kv_store import store_kv

    return store_kv


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
