"""The read roofline of a weight's bytes: how long a kernel that only reads them takes.

Why: the GEMV sweep compares each GEMV with the copy bandwidth of a large copy. At the
7B's small matrices (7-14 MB) a launch's ramp and tail are much of any kernel's time, so
the question "how close can a GEMV get at this size" needs a reader of exactly those
bytes, timed the same way. torch's `sum` is no such reader (13-18% of copy on an H100,
slower than the GEMV itself: h100-s52-lean-gemv-sweep-sm90). This kernel is: every
program streams one contiguous block in wide loads and folds it into one int32 (wrapping
adds, so nothing is wasted on overflow handling), then stores that one word.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192  # int32 words a program reads: 32 KB, about one GEMV trip


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:  # whole blocks: no mask, so the loads are 16 bytes wide
        words = tl.load(x_ptr + offs, eviction_policy="evict_first")
    else:
        words = tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.sum(words, axis=0))


def partial_sums(words: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Read every int32 of `words` (1-D, contiguous) once; one wrapped int32 sum per
    BLOCK-word block (`out` reused when given, for CUDA-graph capture)."""
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError("words: a contiguous 1-D int32 tensor")
    programs = triton.cdiv(words.numel(), BLOCK)
    if out is None:
        out = torch.empty(programs, dtype=torch.int32, device=words.device)
    _read_kernel[(programs,)](words, out, words.numel(), BLOCK=BLOCK, EVEN=words.numel() % BLOCK == 0, num_warps=8)
    return out
