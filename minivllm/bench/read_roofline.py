"""The read roofline of a weight's bytes: how long a kernel that only reads them takes.

Why: the GEMV sweep compares each GEMV with the copy bandwidth of a large copy. At the
7B's small matrices (7-14 MB) a launch's ramp and tail are much of any kernel's time, so
the question "how close can a GEMV get at this size" needs a reader of exactly those
bytes, timed the same way. torch's `sum` is no such reader (13-18% of copy on an H100,
slower than the GEMV itself: h100-s52-lean-gemv-sweep-sm90). This kernel is: every
program streams one contiguous block in wide loads and folds it into one int32 (wrapping
adds, so nothing is wasted on overflow handling), then stores that one word.

`pdl=True` launches it the way the decode step launches the GEMV (kernels/triton/pdl.py):
under programmatic dependent launch, its reads issued before its wait, as the GEMV's early
trips are. In a graph of back-to-back calls that is the ceiling for a GEMV launched that
way, whose own ramp partly hides under its predecessor's tail; without it, the ceiling of
a launch that waits for the previous one to end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers

BLOCK = 8192  # int32 words a program reads: 32 KB, about one GEMV trip


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:  # whole blocks: no mask, so the loads are 16 bytes wide
        words = tl.load(x_ptr + offs, eviction_policy="evict_first")
    else:
        words = tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
    wait_for_producers(PDL)  # after the reads: nothing earlier writes these words
    tl.store(out_ptr + pid, tl.sum(words, axis=0))


def partial_sums(words: torch.Tensor, out: torch.Tensor | None = None, *, pdl: bool = False) -> torch.Tensor:
    """Read every int32 of `words` (1-D, contiguous) once; one wrapped int32 sum per
    BLOCK-word block (`out` reused when given, for CUDA-graph capture). `pdl`: launched
    under programmatic dependent launch where the GPU allows it (`pdl.pdl_args`), reading
    before its wait."""
    if words.dtype != torch.int32 or words.dim() != 1 or not words.is_contiguous():
        raise ValueError("words: a contiguous 1-D int32 tensor")
    programs = triton.cdiv(words.numel(), BLOCK)
    if out is None:
        out = torch.empty(programs, dtype=torch.int32, device=words.device)
    _read_kernel[(programs,)](words, out, words.numel(), BLOCK=BLOCK, EVEN=words.numel() % BLOCK == 0, num_warps=8,
                              **(pdl_args(words.device) if pdl else {}))
    return out
