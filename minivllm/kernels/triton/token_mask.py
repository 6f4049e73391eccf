"""Structured output's token masks applied to logits rows in one Triton launch.

A constrained row's mask arrives as llguidance's bitmask (bit t of int32 word t // 32).
In torch, unpacking it and filling the forbidden logits is six kernels on a [rows, vocab]
tensor (shift, and, bool, invert, masked_fill, and the unpack's broadcast), each a few
microseconds of launch on a decode step that is itself a few milliseconds on an H200.
Here each program reads a block of one row's logits and the words that cover it, and
writes -inf where the bit is clear: the same result as the torch path of
`constraint.mask_in_place`.
Integer and float loads only, no `tl.dot`: compiles for sm_75 (T4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton.paged_attention import require_triton_device

BLOCK = 1024


@triton.jit
def _mask_rows_kernel(logits_ptr, bitmask_ptr, stride_logits, stride_bitmask, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    words = tl.load(bitmask_ptr + row * stride_bitmask + cols // 32, mask=inside, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=inside, other=0.0)
    tl.store(logits_ptr + row * stride_logits + cols, tl.where(allowed, x, float("-inf")), mask=inside)


def mask_rows_inplace(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits[r, t] = -inf wherever bit t of bitmask[r] is clear; `bitmask` (int32,
    [rows, ceil(vocab / 32)]) already on the logits' device. Returns `logits`."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1 or bitmask.dtype != torch.int32:
        raise ValueError("mask_rows_inplace: contiguous rows and an int32 bitmask expected")
    if bitmask.shape[0] != rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"mask_rows_inplace: bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    require_triton_device({"logits": logits, "bitmask": bitmask}, "mask_rows_inplace")
    if rows:
        _mask_rows_kernel[(rows, triton.cdiv(vocab, BLOCK))](logits, bitmask, logits.stride(0), bitmask.stride(0),
                                                             vocab, BLOCK=BLOCK)
    return logits
