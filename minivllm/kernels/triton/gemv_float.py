"""Element decoders for plain float weights (F32, F16, BF16) inside the GEMV kernel.

Same contract as the quant decoders, except that `w_ptr` points at the row data
reinterpreted as float32 / float16 / int16 elements (the caller makes that view) and
`row_off` counts elements, not bytes. A "group" is just GROUP consecutive elements.

BF16 is widened with integer ops (its bits are the top half of a float32), so no
bf16 arithmetic reaches the GPU and the kernel runs on T4 too.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _element_offsets(row_off, g, i):
    return row_off + g * i.shape[2] + i


@triton.jit
def decode_f32(w_ptr, row_off, g, i, mask):
    return tl.load(w_ptr + _element_offsets(row_off, g, i), mask=mask, other=0.0)


@triton.jit
def decode_f16(w_ptr, row_off, g, i, mask):
    return tl.load(w_ptr + _element_offsets(row_off, g, i), mask=mask, other=0.0).to(tl.float32)


@triton.jit
def decode_bf16(w_ptr, row_off, g, i, mask):
    bits = tl.load(w_ptr + _element_offsets(row_off, g, i), mask=mask, other=0).to(tl.int32)
    return (bits << 16).to(tl.float32, bitcast=True)
