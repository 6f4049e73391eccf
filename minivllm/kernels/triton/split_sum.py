"""The split-K sum: the one home of how a GEMV's K-slice partials become its output.

When a GEMV's launch shape splits K into SPLIT slices (`tiled_gemv.py`, `q8_gemv.py`),
each slice's float32 partial sums go to a workspace (SPLIT, M, N) and are added here in
slice order, then the bias, then rounded once to the GEMV's output dtype. A fixed order,
never atomics: batch-invariant mode stays bit-identical.

Four places apply that rule, all through `slice_sum` and `round_to`:

* `tiled_gemv._sum_splits_kernel`: the GEMV's own second launch, which writes the output;
* `last_slice_sums`, inside the GEMV itself (`MINIVLLM_SPLIT_FIXUP=1`, opt-in until a GPU
  has timed it): each program stores its slice's partials, then takes a ticket for its
  output tile (one atomic add); the program that takes the last ticket sums the tile's
  slices in slice order and writes the output. Which program sums is a race; what it
  sums, and in which order, is not, so the bits are the second launch's. It saves that
  launch (~2.5 us in a CUDA graph on an H100, the fused QKV's once a layer). The tickets
  are int32 counters per (tile, row) that the summing program sets back to 0, so they
  are zero between launches; one buffer per device (`split_tickets`). That assumes one
  split GEMV at a time on a device, which holds because the engine runs its forwards on
  one stream (eagerly, or replayed from graphs captured on a side stream, never beside
  another forward); two GEMVs in flight at once would share counters;
* `fused._add_rms_norm_kernel`: given the unsummed `SplitPartials` of the o- or
  down-projection (`QuantLinear.partials`), it sums them while it adds them to the
  residual stream, with the same bits as the separate launch followed by add_rms_norm.
  Why: a profile of one 7B Q4_K_M decode step on an H100 (3.95 ms, issue 41) had 56
  separate split-sum launches, two per layer, at ~2.5 us each (~0.14 ms, ~3.5%);
* `fused._rope_qk_kernel`: given the fused Q|K(|V) GEMV's partials (and V's, where V is
  its own GEMV), it sums each value as it reads it for RoPE and the K/V store
  (`fused.rope_qk_partials`, `fused_projection.qk_v_outputs`): the third split sum of a
  layer gone where QKV splits; opt-in (MINIVLLM_FOLD_QKV_SUM=1), as it lost on an H100
  (`fused_projection.FOLD_QKV_SUM_ENV` says by how much).

`MINIVLLM_FOLD_SPLIT_SUM=0` (`fused_projection.fold_split_sum_enabled`, read by each
forward, so for CUDA graphs when they are captured) keeps the separate launch: the A/B
switch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# `round_to`'s codes: what a float32 value is rounded to before it is used again.
ROUND_CODES = {torch.float16: 16, torch.bfloat16: 17, torch.float32: 0}


@dataclass(frozen=True)
class SplitPartials:
    """A split-K GEMV's output before its slices are summed: `ws` (split, m, n) float32
    partials; the output would be sum over slices in order, + `bias` (float32, or None),
    rounded once to `out_dtype`. Only a kernel that applies `slice_sum` takes it."""

    ws: torch.Tensor
    bias: torch.Tensor | None
    out_dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int]:
        """The (m, n) of the output these partials stand for."""
        return tuple(self.ws.shape[1:])

    @property
    def split(self) -> int:
        return self.ws.shape[0]

    @property
    def round_code(self) -> int:
        return ROUND_CODES[self.out_dtype]


@triton.jit
def slice_sum(ws_ptr, at, ok, stride_ws, bias_ptr, bias_at, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
              L2_ONLY: tl.constexpr = False):
    """Float32 sum of the SPLIT slices' values at offsets `at` (slice 0 first, then 1, ...,
    each slice `stride_ws` elements after the last), then the bias at `bias_at`. With
    SPLIT = 1 it is the value at `at` as float32 (a plain output of any float dtype).
    L2_ONLY: read the slices past the SM's L1 (`.cg`), which may hold a stale copy of a
    line another program wrote during this launch (`last_slice_sums`)."""
    if L2_ONLY:
        y = tl.load(ws_ptr + at, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        for s in tl.static_range(1, SPLIT):
            y += tl.load(ws_ptr + s * stride_ws + at, mask=ok, other=0.0, cache_modifier=".cg")
    else:
        y = tl.load(ws_ptr + at, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLIT):
            y += tl.load(ws_ptr + s * stride_ws + at, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + bias_at, mask=ok, other=0.0)
    return y


@triton.jit
def last_slice_sums(ticket_ptr, ws_ptr, at, ok, stride_ws, bias_ptr, bias_at, out_ptr, out_at,
                    SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Called by every program of a split GEMV after it stored its slice's partials at
    `ws_ptr + at`: the program that takes the tile's last ticket writes out[out_at] =
    the slices summed by `slice_sum` (+ bias), rounded once, and resets the ticket."""
    tl.debug_barrier()  # every thread's partials are stored before the ticket is taken (release below)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == SPLIT - 1:
        y = slice_sum(ws_ptr, at, ok, stride_ws, bias_ptr, bias_at, SPLIT, HAS_BIAS, True)
        tl.store(out_ptr + out_at, y.to(out_ptr.dtype.element_ty), mask=ok)
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # zero for the next launch


@triton.jit
def round_to(v, ROUND: tl.constexpr):
    """Float32 v as a GEMV with that output dtype would have stored it (ROUND: 16 = f16,
    17 = bf16, 0 = float32, unchanged), as float32 again."""
    if ROUND == 16:
        v = v.to(tl.float16).to(tl.float32)
    elif ROUND == 17:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


FIXUP_ENV = "MINIVLLM_SPLIT_FIXUP"
_TICKETS: dict = {}  # device -> int32 counters, zero between launches


def fixup_requested() -> bool:
    """Whether a split GEMV sums its slices itself (`last_slice_sums`); read per call."""
    return os.environ.get(FIXUP_ENV, "0").strip() == "1"


def split_tickets(device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed int32 tickets for split GEMVs on `device`. Grown during a
    CUDA-graph capture, the new buffer comes from the graph's pool and its zeroing is a
    node of the graph: harmless, since tickets are zero at that point of every replay."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < count:
        buf = _TICKETS[device] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return buf
