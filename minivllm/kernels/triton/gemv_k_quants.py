"""Block decoders for the k-quants (256-element super-blocks) inside the dequantize-GEMV kernel.

Same contract as `gemv_legacy_quants.py`: decode(w_ptr, row_off, g, i, mask) returns
float32 weights [BLOCK_N, J, GROUP] for groups `g` of GROUP elements. A group is one
sub-block that shares a scale: 32 elements for Q4_K/Q5_K (8 per super-block), 16 for
Q6_K (16 per super-block), so each scale is decoded once per group, not per element.

The 6-bit scale/min unpacking of Q4_K/Q5_K is done with integer shifts and masks in
the kernel (T4 has nothing better, and it is a few ops per 32 weights). Formulas and
byte layouts follow `minivllm.gguf.dequant`, the reference these kernels are tested
against.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minivllm.kernels.triton.gemv_legacy_quants import load_f16_as_f32


@triton.jit
def _byte(w_ptr, off, mask):
    return tl.load(w_ptr + off, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k_scale_min(w_ptr, scales_off, s, mask):
    """Sub-block s's 6-bit scale and min from the 12 packed bytes at `scales_off`.

    Bytes 0-3: scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7:
    the same for the mins; bytes 8-11: low nibbles of scales 4-7 | mins 4-7 << 4.
    """
    k = s % 4
    lo_sc = _byte(w_ptr, scales_off + k, mask)
    lo_mn = _byte(w_ptr, scales_off + 4 + k, mask)
    packed = _byte(w_ptr, scales_off + 8 + k, mask)
    first_four = s < 4
    sc = tl.where(first_four, lo_sc & 63, (packed & 15) | ((lo_sc >> 6) << 4))
    mn = tl.where(first_four, lo_mn & 63, (packed >> 4) | ((lo_mn >> 6) << 4))
    return sc, mn


@triton.jit
def decode_q4_k(w_ptr, row_off, g, i, mask):
    # f16 d | f16 dmin | 12 B scales/mins | 128 B nibbles (144 bytes, 8 sub-blocks of 32).
    # Nibble bytes come in 4 runs of 32: run r holds sub-block 2r (low) and 2r+1 (high).
    # x = (d * sc) * q - (dmin * m)
    s = g % 8
    base = row_off + (g // 8) * 144
    d = load_f16_as_f32(w_ptr, base, mask)
    dmin = load_f16_as_f32(w_ptr, base + 2, mask)
    sc, mn = _k_scale_min(w_ptr, base + 4, s, mask)
    qs_off = tl.max_contiguous(tl.multiple_of(base + 16 + (s // 2) * 32 + i, [1, 1, 16]), [1, 1, 32])
    q = (_byte(w_ptr, qs_off, mask) >> ((s % 2) * 4)) & 15
    return q.to(tl.float32) * (d * sc.to(tl.float32)) - dmin * mn.to(tl.float32)


@triton.jit
def decode_q5_k(w_ptr, row_off, g, i, mask):
    # f16 d | f16 dmin | 12 B scales/mins | 32 B high bits | 128 B nibbles (176 bytes).
    # The high bit of element i of sub-block s is bit s of high-bit byte i.
    # x = (d * sc) * q - (dmin * m)
    s = g % 8
    base = row_off + (g // 8) * 176
    d = load_f16_as_f32(w_ptr, base, mask)
    dmin = load_f16_as_f32(w_ptr, base + 2, mask)
    sc, mn = _k_scale_min(w_ptr, base + 4, s, mask)
    low = (_byte(w_ptr, base + 48 + (s // 2) * 32 + i, mask) >> ((s % 2) * 4)) & 15
    high = (_byte(w_ptr, base + 16 + i, mask) >> s) & 1
    q = low | (high << 4)
    return q.to(tl.float32) * (d * sc.to(tl.float32)) - dmin * mn.to(tl.float32)


@triton.jit
def decode_q6_k(w_ptr, row_off, g, i, mask):
    # 128 B low nibbles | 64 B high 2-bit pairs | 16 x int8 scales | f16 d (210 bytes),
    # 16 sub-blocks of 16. Element e of the super-block: half h = e // 128, r = e % 128;
    # low nibble: byte h*64 + r%64, nibble r//64; high bits: byte 128 + h*32 + r%32,
    # bit pair r//32. x = (d * sc) * (q - 32)
    t = g % 16
    base = row_off + (g // 16) * 210
    e = t * 16 + i
    h = e // 128
    r = e % 128
    low = (_byte(w_ptr, base + h * 64 + r % 64, mask) >> ((r // 64) * 4)) & 15
    high = (_byte(w_ptr, base + 128 + h * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
    q = low | (high << 4)
    sc = tl.load(w_ptr + base + 192 + t, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    d = load_f16_as_f32(w_ptr, base + 208, mask)
    return (q.to(tl.float32) - 32.0) * (d * sc)
