"""Decoding helpers shared by the repacked-layout GEMV kernels (`repacked_gemv.py`,
`tiled_gemv.py`): quant codes and small integers to float32 without I2F instructions.

The code of field p is masked in place and OR-ed into the mantissa of 2^(23 - bits*p),
then the constant is subtracted in float32, which is exact:

    bits(2^(23 - 4p)) | (q << 4p)  ==  2^(23 - 4p) + q      (q << 4p < 2^23)

(I2F runs at 1/8 of the FMA rate on sm_80+; this is one LOP3 and one FADD, and the FADD
also removes the type's offset: 8, 16, 32 or 128.)

ONES (optional): the field's all-ones value (15) as a *runtime* number. The LOP3 needs the
mask or the magic in a register; with both compile-time constants ptxas made the magic the
immediate and rematerialised the mask (MOV / HFMA2.MMA) before most LOP3s, inside the
GEMV's loop. Masks derived from a runtime value stay in registers: the tiled GEMV's sm_90
loop went from 856 to ~732 instructions a trip (128 weights a thread), same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def field(src, P: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, ONES=None):
    """Field P (in place: P < 32 // BITS // 2) of each int32 as float32, minus OFFSET."""
    if ONES is None:
        mask = ((1 << BITS) - 1) << (BITS * P)
    elif BITS == 8:
        mask = ((ONES << 4) | ONES) << (8 * P)
    else:
        mask = ONES << (BITS * P)
    magic: tl.constexpr = (150 - BITS * P) << 23
    base: tl.constexpr = (1 << (23 - BITS * P)) * 1.0 + OFFSET
    return ((src & mask) | magic).to(tl.float32, bitcast=True) - base


@triton.jit
def field_hi(src, hsrc, P: tl.constexpr, HBITS: tl.constexpr, OFFSET: tl.constexpr, ONES=None):
    """A nibble P in place plus HBITS high bits that `hsrc` holds just above it."""
    if ONES is None:
        mask = 15 << (4 * P)
        hmask = ((1 << HBITS) - 1) << (4 * P + 4)
    else:
        mask = ONES << (4 * P)
        hmask = (ONES >> (4 - HBITS)) << (4 * P + 4)
    magic: tl.constexpr = (150 - 4 * P) << 23
    base: tl.constexpr = (1 << (23 - 4 * P)) * 1.0 + OFFSET
    return ((src & mask) | (hsrc & hmask) | magic).to(tl.float32, bitcast=True) - base


@triton.jit
def u8_to_f32(v):
    """0..255 (any int type) as float32 without I2F: OR into the mantissa of 2^23."""
    return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def i8_to_f32(v):
    """-128..127 (int8) as float32 without I2F, through 2^23 + 2^22."""
    return (v.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0
