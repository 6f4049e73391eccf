"""Block decoders for the legacy 32-element GGUF quants, used inside the dequantize-GEMV kernel.

Every decoder has the signature the GEMV kernel (`dequant_gemv.py`) calls:

    decode(w_ptr, row_off, g, i, mask) -> float32 weights of shape [BLOCK_N, J, 32]

`w_ptr` points at the raw uint8 blocks, `row_off` ([BLOCK_N, 1, 1], int64) is each
output row's byte offset, `g` ([1, J, 1]) the block index within the row and `i`
([1, 1, 32]) the element inside the block; `mask` ([BLOCK_N, J, 1]) says which
(row, block) pairs exist. The formulas follow `minivllm.gguf.dequant` (the reference)
and the byte layouts in its comments; only integer ops and float32 arithmetic are
used, so they compile for sm_75 (T4) as well as Hopper.

Byte loads that repeat (both nibbles of a byte, the per-block scales) hit L1: what
matters for speed is that every byte of the weight is fetched from DRAM once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_f16_as_f32(w_ptr, off, mask):
    """The little-endian f16 stored at byte `off`, as float32.

    Assembled from two bytes because block sizes such as 18 or 34 leave the field
    only 2-byte aligned relative to the row and the row start is only byte-aligned
    as far as the compiler knows.
    """
    lo = tl.load(w_ptr + off, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(w_ptr + off + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(w_ptr, qs_off, i, mask):
    """Element i of a block whose 32 4-bit quants are 16 bytes at `qs_off`:
    elements 0-15 are the low nibbles, 16-31 the high nibbles."""
    byte = tl.load(w_ptr + qs_off + (i % 16), mask=mask, other=0).to(tl.int32)
    return (byte >> ((i // 16) * 4)) & 15


@triton.jit
def _fifth_bit(w_ptr, qh_off, i, mask):
    """Bit i of the little-endian u32 at `qh_off`: the 5th bit of element i (Q5_0/Q5_1)."""
    byte = tl.load(w_ptr + qh_off + (i // 8), mask=mask, other=0).to(tl.int32)
    return (byte >> (i % 8)) & 1


@triton.jit
def decode_q4_0(w_ptr, row_off, g, i, mask):
    # f16 d | 16 B nibbles (18 bytes). x = d * (q - 8)
    base = row_off + g * 18
    d = load_f16_as_f32(w_ptr, base, mask)
    q = _nibble(w_ptr, base + 2, i, mask)
    return (q.to(tl.float32) - 8.0) * d


@triton.jit
def decode_q4_1(w_ptr, row_off, g, i, mask):
    # f16 d | f16 m | 16 B nibbles (20 bytes). x = d * q + m
    base = row_off + g * 20
    d = load_f16_as_f32(w_ptr, base, mask)
    m = load_f16_as_f32(w_ptr, base + 2, mask)
    q = _nibble(w_ptr, base + 4, i, mask)
    return q.to(tl.float32) * d + m


@triton.jit
def decode_q5_0(w_ptr, row_off, g, i, mask):
    # f16 d | u32 qh | 16 B nibbles (22 bytes). x = d * (q - 16)
    base = row_off + g * 22
    d = load_f16_as_f32(w_ptr, base, mask)
    q = _nibble(w_ptr, base + 6, i, mask) | (_fifth_bit(w_ptr, base + 2, i, mask) << 4)
    return (q.to(tl.float32) - 16.0) * d


@triton.jit
def decode_q5_1(w_ptr, row_off, g, i, mask):
    # f16 d | f16 m | u32 qh | 16 B nibbles (24 bytes). x = d * q + m
    base = row_off + g * 24
    d = load_f16_as_f32(w_ptr, base, mask)
    m = load_f16_as_f32(w_ptr, base + 2, mask)
    q = _nibble(w_ptr, base + 8, i, mask) | (_fifth_bit(w_ptr, base + 4, i, mask) << 4)
    return q.to(tl.float32) * d + m


@triton.jit
def decode_q8_0(w_ptr, row_off, g, i, mask):
    # f16 d | 32 x int8 (34 bytes). x = d * q
    base = row_off + g * 34
    d = load_f16_as_f32(w_ptr, base, mask)
    q = tl.load(w_ptr + base + 2 + i, mask=mask, other=0).to(tl.int8, bitcast=True)
    return q.to(tl.float32) * d
