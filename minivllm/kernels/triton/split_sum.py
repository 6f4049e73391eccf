"""The split-K sum: the one home of how a GEMV's K-slice partials become its output.

When a GEMV's launch shape splits K into SPLIT slices (`tiled_gemv.py`, `q8_gemv.py`),
each slice's float32 partial sums go to a workspace (SPLIT, M, N) and are added here in
slice order, then the bias, then rounded once to the GEMV's output dtype. A fixed order,
never atomics: batch-invariant mode stays bit-identical.

Two kernels apply that rule, both through `slice_sum` and `round_to`:

* `tiled_gemv._sum_splits_kernel`: the GEMV's own second launch, which writes the output;
* `fused._add_rms_norm_kernel`: given the unsummed `SplitPartials` of the o- or
  down-projection (`QuantLinear.partials`), it sums them while it adds them to the
  residual stream, with the same bits as the separate launch followed by add_rms_norm.
  Why: a profile of one 7B Q4_K_M decode step on an H100 (3.95 ms, issue 41) had 56
  separate split-sum launches, two per layer, at ~2.5 us each (~0.14 ms, ~3.5%).

`MINIVLLM_FOLD_SPLIT_SUM=0` (`fused_projection.fold_split_sum_enabled`, read by each
forward, so for CUDA graphs when they are captured) keeps the separate launch: the A/B
switch.
"""

from __future__ import annotations

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
def slice_sum(ws_ptr, at, ok, stride_ws, bias_ptr, bias_at, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Float32 sum of the SPLIT slices' values at offsets `at` (slice 0 first, then 1, ...,
    each slice `stride_ws` elements after the last), then the bias at `bias_at`. With
    SPLIT = 1 it is the value at `at` as float32 (a plain output of any float dtype)."""
    y = tl.load(ws_ptr + at, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        y += tl.load(ws_ptr + s * stride_ws + at, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + bias_at, mask=ok, other=0.0)
    return y


@triton.jit
def round_to(v, ROUND: tl.constexpr):
    """Float32 v as a GEMV with that output dtype would have stored it (ROUND: 16 = f16,
    17 = bf16, 0 = float32, unchanged), as float32 again."""
    if ROUND == 16:
        v = v.to(tl.float16).to(tl.float32)
    elif ROUND == 17:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v
