"""GEMV over a GPU-friendly repacking of GGUF blocks, built once at load.

Why: the file's blocks (18, 22, 34, 144 or 210 bytes, fields at odd offsets) force a
kernel into byte loads and per-element shifts, and the fused kernel of
`dequant_gemv.py` moved weights at 9-16% of the H200's copy bandwidth. Here every
weight type is split into aligned planes that a program reads with 16-byte loads:

* quant words: int32, 8 four-bit codes (4-bit types and the low nibbles of Q5_0/Q6_K)
  or 4 eight-bit codes (Q8_0, stored as q + 128) per word;
* high bits: Q5_0's fifth bit (one int32 per 32 elements), Q6_K's two high bits (one
  int16 per 8 elements);
* scales: the file's own f16 / 6-bit / int8 values, unchanged (so the arithmetic is the
  reference's), in arrays of their own.

Memory stays about the file size (Q4_K: 0.578 bytes per weight against the file's
0.5625; the others equal or less).

Layout. Rows are interleaved in groups of R = 4: plane[nb, g, t, r] for output row
n = nb * R + r, 32-element group g of that row and word t of the group. Element
i = p * T + t of a group (T words per group, p the field within a word) sits in field p
of word t. So a thread that loads the 16 bytes (g, t, r = 0..3) holds one field position
of four rows, the activation x[g*32 + p*T + t] it needs is one value shared by those
four rows, and for a fixed p the T words of a group need T consecutive activations.

Decoding without int->float conversions (I2F runs at 1/8 of the FMA rate on sm_80+):
the code of field p is masked in place and OR-ed into the mantissa of 2^(23 - 4p') (or
2^(23 - 8p') for bytes), then the constant is subtracted in float32, which is exact:

    bits(2^(23 - 4p')) | (q << 4p')  ==  2^(23 - 4p') + q      (q << 4p' < 2^23)

so a weight costs one LOP3, one FADD (which also removes the type's offset: 8, 16, 32,
128) and one FFMA; group scales are applied once per 8 (or 4) weights, mins once per
group through the group's activation sum. Only integer ops and float32 arithmetic: no
`tl.dot`, no bf16 arithmetic, so it compiles for sm_75 (T4) as for Hopper.

Each (activation row, row group) is one program that walks the whole K, with a fixed
launch configuration when `invariant=True`: a row's result is then bitwise independent
of M and of the other rows (batch-invariant mode).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from minivllm.errors import ConfigError, DeviceError
from minivllm.gguf.dequant import _bits_u32, _fields, _k_scales_mins
from minivllm.gguf.quant_types import SUPPORTED_TYPES
from minivllm.kernels.quant_weight import QuantizedWeight

_T = GGMLQuantizationType
R = 4  # rows interleaved per row group

# Kernel kinds (compile-time constants).
K_Q4_0, K_Q4_1, K_Q5_0, K_Q8_0, K_Q4_K, K_Q6_K = range(6)
_KIND = {_T.Q4_0: K_Q4_0, _T.Q4_1: K_Q4_1, _T.Q5_0: K_Q5_0, _T.Q8_0: K_Q8_0, _T.Q4_K: K_Q4_K, _T.Q6_K: K_Q6_K}
REPACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_KIND)


@dataclass
class RepackedWeight:
    """An (N, K) GGUF weight split into the planes described in the module docstring."""

    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]
    name: str
    qs: torch.Tensor  # int32 (NB, G, T, R)
    planes: dict[str, torch.Tensor] = field(default_factory=dict)  # high bits and scales

    @property
    def kind(self) -> int:
        return _KIND[self.ggml_type]

    @property
    def words_per_group(self) -> int:
        return 8 if self.ggml_type == _T.Q8_0 else 4

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        return self.qs.numel() * 4 + sum(p.numel() * p.element_size() for p in self.planes.values())

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.to_quantized().dequantize(dtype)

    def to_quantized(self) -> QuantizedWeight:
        """The file's blocks again, byte for byte (a temporary: e.g. for the GEMM path)."""
        return QuantizedWeight(unpack_raw(self), self.ggml_type, self.shape, self.name)


# --- repacking (torch, on the weight's device) -------------------------------------------


def _interleave(a: torch.Tensor, n: int) -> torch.Tensor:
    """(N, *rest) -> (NB, *rest, R): rows padded to a multiple of R, R innermost."""
    pad = -n % R
    if pad:
        a = torch.cat([a, a.new_zeros((pad, *a.shape[1:]))])
    nb = a.shape[0] // R
    a = a.reshape(nb, R, *a.shape[1:])
    return a.movedim(1, -1).contiguous()


def _deinterleave(a: torch.Tensor, n: int) -> torch.Tensor:
    return a.movedim(-1, 1).reshape(-1, *a.shape[1:-1])[:n]


def _pack_fields(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., 32) uint8 in element order -> int32 words (..., T): element
    i = p * T + t in field p (bits [p*bits, (p+1)*bits)) of word t."""
    per = 32 // bits
    t = 32 // per
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], per, t)  # [.., p, t]
    shifts = (torch.arange(per, device=codes.device, dtype=torch.int64) * bits).view(per, 1)
    words = (c << shifts).sum(dim=-2)
    return words.to(torch.int64).where(words < 2**31, words - 2**32).to(torch.int32)


def _unpack_fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    per = 32 // bits
    # int32 shifts (arithmetic, but every field is masked), so no int64 temporaries.
    shifts = (torch.arange(per, device=words.device, dtype=torch.int32) * bits).view(per, 1)
    c = (words.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)  # [.., p, t]
    return c.reshape(*words.shape[:-1], 32).to(torch.uint8)


def _f16_field(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[:, at:at + 2].contiguous().view(torch.float16).reshape(-1)


def _as_u8(h: torch.Tensor) -> torch.Tensor:
    return h.contiguous().view(torch.uint8).reshape(h.shape[0], -1)


def repack(w: QuantizedWeight) -> RepackedWeight:
    """Split `w`'s blocks into the GPU planes (exact: `unpack_raw` gives the bytes back)."""
    t = w.ggml_type
    if t not in _KIND:
        raise ConfigError("repack", w.type_name, f"allowed: {', '.join(sorted(x.name for x in _KIND))}")
    n, k = w.shape
    qt = SUPPORTED_TYPES[t]
    b = w.raw.reshape(n * k // qt.block_size, qt.type_size)
    g = k // 32
    planes: dict[str, torch.Tensor] = {}

    def plane(name, values):  # values (N * groups_or_blocks, ...) -> interleaved
        planes[name] = _interleave(values.reshape(n, -1, *values.shape[1:]), n)

    if t in (_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q8_0):
        if t == _T.Q4_0:
            codes = _fields(b[:, 2:], 4).reshape(-1, 32)
            plane("d", _f16_field(b, 0))
        elif t == _T.Q4_1:
            codes = _fields(b[:, 4:], 4).reshape(-1, 32)
            plane("d", _f16_field(b, 0))
            plane("m", _f16_field(b, 2))
        elif t == _T.Q5_0:
            lo = _fields(b[:, 6:], 4).reshape(-1, 32)
            hi = _bits_u32(b[:, 2:6])
            codes = lo
            plane("d", _f16_field(b, 0))
            plane("qh", _pack_q5_high(hi))
        else:
            codes = (b[:, 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
            plane("d", _f16_field(b, 0))
        bits = 8 if t == _T.Q8_0 else 4
        qs = _interleave(_pack_fields(codes, bits).reshape(n, g, -1), n)
    elif t == _T.Q4_K:
        nsb = b.shape[0]
        sc, mn = _k_scales_mins(b[:, 4:16])  # (nsb, 8) uint8
        codes = _fields(b[:, 16:].reshape(nsb, 4, 32), 4).reshape(nsb * 8, 32)
        plane("d", _f16_field(b, 0))
        plane("dmin", _f16_field(b, 2))
        plane("sc", sc.reshape(-1).contiguous())
        plane("mn", mn.reshape(-1).contiguous())
        qs = _interleave(_pack_fields(codes, 4).reshape(n, g, 4), n)
    else:  # Q6_K
        nsb = b.shape[0]
        lo = _fields(b[:, :128].reshape(nsb, 2, 64), 4).reshape(nsb * 8, 32)
        hi = _fields(b[:, 128:192].reshape(nsb, 2, 32), 2).reshape(nsb * 8, 32)
        sc = b[:, 192:208].view(torch.int8).reshape(nsb * 8, 2)  # two 16-element scales per group
        plane("d", _f16_field(b, 208))
        plane("sc_lo", sc[:, 0].contiguous())
        plane("sc_hi", sc[:, 1].contiguous())
        plane("qh", _pack_q6_high(hi))
        qs = _interleave(_pack_fields(lo, 4).reshape(n, g, 4), n)
    return RepackedWeight(t, (n, k), w.name, qs, planes)


def _pack_q5_high(hi: torch.Tensor) -> torch.Tensor:
    """(groups, 32) bits in element order -> int32 per group, element (p, t) at bit
    16 * (p // 4) + 4 * (p % 4) + t (so `(h >> t) << 4` / `(h >> t) >> 12` put the bits of
    fields 0-3 / 4-7 just above their nibbles)."""
    h = hi.to(torch.int64).reshape(-1, 8, 4)  # [p, t]
    p = torch.arange(8, device=hi.device).view(8, 1)
    tt = torch.arange(4, device=hi.device).view(1, 4)
    pos = 16 * (p // 4) + 4 * (p % 4) + tt
    words = (h << pos).sum(dim=(-1, -2))
    return words.where(words < 2**31, words - 2**32).to(torch.int32)


def _unpack_q5_high(words: torch.Tensor) -> torch.Tensor:
    w = words.to(torch.int64).reshape(-1) & 0xFFFFFFFF
    p = torch.arange(8, device=words.device).view(8, 1)
    tt = torch.arange(4, device=words.device).view(1, 4)
    pos = 16 * (p // 4) + 4 * (p % 4) + tt
    return ((w.view(-1, 1, 1) >> pos) & 1).reshape(-1, 32).to(torch.uint8)


def _pack_q6_high(hi: torch.Tensor) -> torch.Tensor:
    """(groups, 32) 2-bit values in element order -> int16 (groups, T=4), element (p, t)
    at bits 4 * (p % 4) + 2 * (p // 4) of word t (`h << 4` / `h << 2` put fields 0-3 /
    4-7 just above their nibbles)."""
    h = hi.to(torch.int64).reshape(-1, 8, 4)  # [p, t]
    p = torch.arange(8, device=hi.device).view(8, 1)
    pos = 4 * (p % 4) + 2 * (p // 4)
    words = (h << pos).sum(dim=-2)  # (groups, 4)
    return words.where(words < 2**15, words - 2**16).to(torch.int16)


def _unpack_q6_high(words: torch.Tensor) -> torch.Tensor:
    w = words.to(torch.int64) & 0xFFFF  # (groups, 4)
    p = torch.arange(8, device=words.device).view(8, 1)
    pos = 4 * (p % 4) + 2 * (p // 4)
    return ((w.unsqueeze(-2) >> pos) & 3).reshape(-1, 32).to(torch.uint8)


def _nib_bytes(codes: torch.Tensor) -> torch.Tensor:
    """(blocks, 32) 4-bit codes -> GGUF's 16 bytes: byte i = q[i] | q[i + 16] << 4."""
    return codes[:, :16] | (codes[:, 16:] << 4)


# Rows unpacked per piece: the temporaries of one piece stay near 64 MB whatever the
# matrix (a T4 without room for dense copies rebuilds the bytes for every prefill GEMM).
_UNPACK_ROWS = 2048


def unpack_raw(rw: RepackedWeight) -> torch.Tensor:
    """The GGUF bytes (N, row_bytes) uint8 that `repack` was given (built in row pieces)."""
    n, k = rw.shape
    if n <= _UNPACK_ROWS:
        return _unpack_raw(rw)
    step = _UNPACK_ROWS // R
    pieces = []
    for nb0 in range(0, rw.qs.shape[0], step):
        rows = min(n - nb0 * R, step * R)
        part = RepackedWeight(rw.ggml_type, (rows, k), rw.name, rw.qs[nb0:nb0 + step],
                              {name: a[nb0:nb0 + step] for name, a in rw.planes.items()})
        pieces.append(_unpack_raw(part))
    return torch.cat(pieces)


def _unpack_raw(rw: RepackedWeight) -> torch.Tensor:
    t = rw.ggml_type
    n, k = rw.shape
    qt = SUPPORTED_TYPES[t]
    pl = {name: _deinterleave(a, n) for name, a in rw.planes.items()}
    bits = 8 if t == _T.Q8_0 else 4
    codes = _unpack_fields(_deinterleave(rw.qs, n).reshape(-1, 32 // (32 // bits)), bits)
    codes = codes.reshape(-1, 32)

    def f16(name):
        return pl[name].reshape(-1, 1).contiguous().view(torch.uint8).reshape(-1, 2)

    if t == _T.Q4_0:
        blocks = torch.cat([f16("d"), _nib_bytes(codes)], dim=1)
    elif t == _T.Q4_1:
        blocks = torch.cat([f16("d"), f16("m"), _nib_bytes(codes)], dim=1)
    elif t == _T.Q5_0:
        hi = _unpack_q5_high(pl["qh"])  # (blocks, 32)
        qh = (hi.to(torch.int64) << torch.arange(32, device=hi.device)).sum(dim=1)
        qh_bytes = torch.stack([(qh >> (8 * j)) & 0xFF for j in range(4)], dim=1).to(torch.uint8)
        blocks = torch.cat([f16("d"), qh_bytes, _nib_bytes(codes)], dim=1)
    elif t == _T.Q8_0:
        q = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        blocks = torch.cat([f16("d"), q], dim=1)
    elif t == _T.Q4_K:
        nsb = codes.shape[0] // 8
        sc = pl["sc"].reshape(nsb, 8).to(torch.int32)
        mn = pl["mn"].reshape(nsb, 8).to(torch.int32)
        scales = torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
                            (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6),
                            (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], dim=1).to(torch.uint8)
        c = codes.reshape(nsb, 4, 2, 32)  # run r holds sub-blocks 2r (low nibble) and 2r+1 (high)
        qs = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(nsb, 128)
        blocks = torch.cat([f16("d"), f16("dmin"), scales, qs], dim=1)
    else:  # Q6_K
        nsb = codes.shape[0] // 8
        lo = codes.reshape(nsb, 2, 2, 64)  # [half, nibble field, byte]
        ql = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nsb, 128)
        hi = _unpack_q6_high(pl["qh"].reshape(-1, 4)).reshape(nsb, 2, 4, 32)  # [half, field, byte]
        qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nsb, 64)
        sc = torch.stack([pl["sc_lo"].reshape(-1), pl["sc_hi"].reshape(-1)], dim=1).reshape(nsb, 16)
        blocks = torch.cat([ql, qh, sc.view(torch.uint8), f16("d")], dim=1)
    assert blocks.shape[1] == qt.type_size
    return blocks.reshape(n, -1).contiguous()


# --- the kernel ---------------------------------------------------------------------------


@triton.jit
def _field(src, P: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr):
    """Field P (in place: P < 32 // BITS // 2) of each int32 as float32, minus OFFSET."""
    mask: tl.constexpr = ((1 << BITS) - 1) << (BITS * P)
    magic: tl.constexpr = (150 - BITS * P) << 23
    base: tl.constexpr = (1 << (23 - BITS * P)) * 1.0 + OFFSET
    return ((src & mask) | magic).to(tl.float32, bitcast=True) - base


@triton.jit
def _field_hi(src, hsrc, P: tl.constexpr, HBITS: tl.constexpr, OFFSET: tl.constexpr):
    """A nibble P in place plus HBITS high bits that `hsrc` holds just above it."""
    mask: tl.constexpr = 15 << (4 * P)
    hmask: tl.constexpr = ((1 << HBITS) - 1) << (4 * P + 4)
    magic: tl.constexpr = (150 - 4 * P) << 23
    base: tl.constexpr = (1 << (23 - 4 * P)) * 1.0 + OFFSET
    return ((src & mask) | (hsrc & hmask) | magic).to(tl.float32, bitcast=True) - base


@triton.jit
def _u8_to_f32(v):
    """0..255 (any int type) as float32 without I2F: OR into the mantissa of 2^23."""
    return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _i8_to_f32(v):
    """-128..127 (int8) as float32 without I2F, through 2^23 + 2^22."""
    return (v.to(tl.int32) + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit(do_not_specialize=["M", "stride_xk"])
def _repacked_gemv_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_xk, stride_om,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_G: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    # Activation rows vary fastest, so the M programs of one row group run together and
    # all but the first find its weights in L2.
    pid = tl.program_id(0)
    pid_m = pid % M
    nb = pid // M  # int32 offsets: a plane holds far fewer than 2**31 elements
    offs_g = tl.arange(0, BLOCK_G)
    offs_t = tl.arange(0, T)
    offs_r = tl.arange(0, RR)
    g3 = offs_g[:, None, None]
    t3 = offs_t[None, :, None]
    r3 = offs_r[None, None, :]
    x_row = x_ptr + pid_m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
    for g0 in range(0, N_GROUPS, BLOCK_G):
        gg = g0 + g3
        g_ok = gg < N_GROUPS
        # Per-(group, row) planes are read through [G, T, R] pointers (t stride 0): the same
        # shape and contiguity as the weight tile, hence the same register layout.
        gr = (nb * N_GROUPS + gg) * RR + r3 + t3 * 0
        w = tl.load(q_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0)
        # Activations of field p of every word: x[g*32 + p*T + t], one per (g, t), shared by
        # the R rows. stride_xk is a runtime value, so each thread loads its own element in
        # the slice layout of the weight tile (no layout conversion).
        g2 = g0 + offs_g[:, None]
        x_off = (g2 * 32 + offs_t[None, :]) * stride_xk
        x_ok = g2 < N_GROUPS
        if KIND == 3:  # Q8_0: 4 bytes per word, stored as q + 128
            ps = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
            w_hi = w >> 16
            for p in tl.static_range(4):
                xp = tl.load(x_row + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
                if p < 2:
                    f = _field(w, p, 8, 128)
                else:
                    f = _field(w_hi, p - 2, 8, 128)
                ps += f * xp[:, :, None]
            d = tl.load(a_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
            acc += ps * d
        elif KIND == 5:  # Q6_K: nibble plane + 2-bit plane, two 16-element scales per group
            h = tl.load(b_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0).to(tl.int32)
            h_lo = h << 4
            h_hi = h << 2
            w_hi = w >> 16
            ps_lo = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
            ps_hi = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
            for p in tl.static_range(8):
                xp = tl.load(x_row + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
                if p < 4:
                    ps_lo += _field_hi(w, h_lo, p, 2, 32) * xp[:, :, None]
                else:
                    ps_hi += _field_hi(w_hi, h_hi, p - 4, 2, 32) * xp[:, :, None]
            s_lo = _i8_to_f32(tl.load(c_ptr + gr, mask=g_ok, other=0))
            s_hi = _i8_to_f32(tl.load(e_ptr + gr, mask=g_ok, other=0))
            d = tl.load(a_ptr + (nb * (N_GROUPS // 8) + gg // 8) * RR + r3 + t3 * 0, mask=g_ok, other=0.0).to(tl.float32)
            acc += (ps_lo * s_lo + ps_hi * s_hi) * d
        else:  # 4-bit codes: Q4_0, Q4_1, Q5_0, Q4_K
            w_hi = w >> 16
            if KIND == 2:  # Q5_0: the fifth bits of the group, element (p, t) at 16(p//4) + 4(p%4) + t
                h = tl.load(b_ptr + gr, mask=g_ok, other=0) >> t3
                h_lo = h << 4
                h_hi = h >> 12
            ps = tl.zeros([BLOCK_G, T, RR], dtype=tl.float32)
            sx = tl.zeros([BLOCK_G, T], dtype=tl.float32)
            for p in tl.static_range(8):
                xp = tl.load(x_row + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
                if KIND == 2:
                    if p < 4:
                        f = _field_hi(w, h_lo, p, 1, 16)
                    else:
                        f = _field_hi(w_hi, h_hi, p - 4, 1, 16)
                elif KIND == 0:
                    if p < 4:
                        f = _field(w, p, 4, 8)
                    else:
                        f = _field(w_hi, p - 4, 4, 8)
                else:
                    if p < 4:
                        f = _field(w, p, 4, 0)
                    else:
                        f = _field(w_hi, p - 4, 4, 0)
                    sx += xp
                ps += f * xp[:, :, None]
            if KIND == 1:  # Q4_1: d * q + m
                d = tl.load(a_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
                m = tl.load(b_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
                acc += ps * d + m * sx[:, :, None]
            elif KIND == 4:  # Q4_K: (d * sc) * q - (dmin * m)
                sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r3 + t3 * 0
                d = tl.load(a_ptr + sb, mask=g_ok, other=0.0).to(tl.float32)
                dmin = tl.load(b_ptr + sb, mask=g_ok, other=0.0).to(tl.float32)
                sc = _u8_to_f32(tl.load(c_ptr + gr, mask=g_ok, other=0))
                mn = _u8_to_f32(tl.load(e_ptr + gr, mask=g_ok, other=0))
                acc += ps * (d * sc) - (dmin * mn) * sx[:, :, None]
            else:  # Q4_0, Q5_0: d * (q - offset), the offset already subtracted
                d = tl.load(a_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
                acc += ps * d
    y = tl.sum(tl.sum(acc, axis=1), axis=0)  # [R]
    rows = nb * RR + offs_r
    r_ok = rows < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=r_ok, other=0.0)
    tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=r_ok)


@triton.jit(do_not_specialize=["M", "stride_xk"])
def _repacked_gemv_rows_kernel(
    x_ptr, q_ptr, a_ptr, b_ptr, c_ptr, e_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_xk, stride_om,
    N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """`_repacked_gemv_kernel` for BLOCK_M activation rows at once: each weight field is
    decoded once and multiplied into every row (the one-row kernel decodes it once per
    row, which on a T4 makes batched decode arithmetic-bound)."""
    pid = tl.program_id(0)
    n_mb = tl.cdiv(M, BLOCK_M)
    mb = pid % n_mb
    nb = pid // n_mb
    offs_g = tl.arange(0, BLOCK_G)
    g3 = offs_g[:, None, None]
    t3 = tl.arange(0, T)[None, :, None]
    r3 = tl.arange(0, RR)[None, None, :]
    ms = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    x_rows = x_ptr + (ms.to(tl.int64) * stride_xm)[:, None, None]  # [BM, 1, 1]
    acc = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
    for g0 in range(0, N_GROUPS, BLOCK_G):
        gg = g0 + g3
        g_ok = gg < N_GROUPS
        gr = (nb * N_GROUPS + gg) * RR + r3 + t3 * 0
        w = tl.load(q_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0)
        g2 = (g0 + offs_g[:, None])[None]  # [1, G, 1]
        x_off = (g2 * 32 + tl.arange(0, T)[None, None, :]) * stride_xk  # [1, G, T]
        x_ok = m_ok[:, None, None] & (g2 < N_GROUPS)
        w_hi = w >> 16
        if KIND == 3:  # Q8_0
            ps = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
            for p in tl.static_range(4):
                xp = tl.load(x_rows + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
                if p < 2:
                    f = _field(w, p, 8, 128)
                else:
                    f = _field(w_hi, p - 2, 8, 128)
                ps += f[None] * xp[:, :, :, None]
            d = tl.load(a_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
            acc += ps * d[None]
        elif KIND == 5:  # Q6_K
            h = tl.load(b_ptr + ((nb * N_GROUPS + gg) * T + t3) * RR + r3, mask=g_ok, other=0).to(tl.int32)
            h_lo = h << 4
            h_hi = h << 2
            ps_lo = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
            ps_hi = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
            for p in tl.static_range(8):
                xp = tl.load(x_rows + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
                if p < 4:
                    ps_lo += _field_hi(w, h_lo, p, 2, 32)[None] * xp[:, :, :, None]
                else:
                    ps_hi += _field_hi(w_hi, h_hi, p - 4, 2, 32)[None] * xp[:, :, :, None]
            s_lo = _i8_to_f32(tl.load(c_ptr + gr, mask=g_ok, other=0))
            s_hi = _i8_to_f32(tl.load(e_ptr + gr, mask=g_ok, other=0))
            d = tl.load(a_ptr + (nb * (N_GROUPS // 8) + gg // 8) * RR + r3 + t3 * 0, mask=g_ok, other=0.0).to(tl.float32)
            acc += (ps_lo * s_lo[None] + ps_hi * s_hi[None]) * d[None]
        else:  # 4-bit codes
            if KIND == 2:
                h = tl.load(b_ptr + gr, mask=g_ok, other=0) >> t3
                h_lo = h << 4
                h_hi = h >> 12
            ps = tl.zeros([BLOCK_M, BLOCK_G, T, RR], dtype=tl.float32)
            sx = tl.zeros([BLOCK_M, BLOCK_G, T], dtype=tl.float32)
            for p in tl.static_range(8):
                xp = tl.load(x_rows + x_off + p * T * stride_xk, mask=x_ok, other=0.0).to(tl.float32)
                if KIND == 2:
                    if p < 4:
                        f = _field_hi(w, h_lo, p, 1, 16)
                    else:
                        f = _field_hi(w_hi, h_hi, p - 4, 1, 16)
                elif KIND == 0:
                    if p < 4:
                        f = _field(w, p, 4, 8)
                    else:
                        f = _field(w_hi, p - 4, 4, 8)
                else:
                    if p < 4:
                        f = _field(w, p, 4, 0)
                    else:
                        f = _field(w_hi, p - 4, 4, 0)
                    sx += xp
                ps += f[None] * xp[:, :, :, None]
            if KIND == 1:
                d = tl.load(a_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
                m = tl.load(b_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
                acc += ps * d[None] + m[None] * sx[:, :, :, None]
            elif KIND == 4:
                sb = (nb * (N_GROUPS // 8) + gg // 8) * RR + r3 + t3 * 0
                d = tl.load(a_ptr + sb, mask=g_ok, other=0.0).to(tl.float32)
                dmin = tl.load(b_ptr + sb, mask=g_ok, other=0.0).to(tl.float32)
                sc = _u8_to_f32(tl.load(c_ptr + gr, mask=g_ok, other=0))
                mn = _u8_to_f32(tl.load(e_ptr + gr, mask=g_ok, other=0))
                acc += ps * (d * sc)[None] - (dmin * mn)[None] * sx[:, :, :, None]
            else:
                d = tl.load(a_ptr + gr, mask=g_ok, other=0.0).to(tl.float32)
                acc += ps * d[None]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BM, R]
    rows = nb * RR + tl.arange(0, RR)
    r_ok = rows < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=r_ok, other=0.0)[None, :]
    o = out_ptr + (ms.to(tl.int64) * stride_om)[:, None] + rows[None, :]
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


# Fixed configuration (invariant mode, the interpreter, and any M): BLOCK_G groups of 32
# elements per loop trip. 64 groups x 4 rows x 16 B = 4 KB of weights per trip (Q4_K).
_FIXED = dict(BLOCK_G=64, num_warps=4)


def _autotuned_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_G": bg}, num_warps=nw) for bg, nw in [(32, 2), (64, 4), (128, 4), (128, 8), (64, 2)]]


_repacked_gemv_tuned = triton.autotune(configs=_autotuned_configs(), key=["N", "N_GROUPS", "KIND"])(_repacked_gemv_kernel)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_PLANE_ORDER = {
    _T.Q4_0: ("d", None, None, None), _T.Q4_1: ("d", "m", None, None), _T.Q5_0: ("d", "qh", None, None),
    _T.Q8_0: ("d", None, None, None), _T.Q4_K: ("d", "dmin", "sc", "mn"), _T.Q6_K: ("d", "qh", "sc_lo", "sc_hi"),
}


def repacked_gemv(x: torch.Tensor, w: RepackedWeight, *, invariant: bool = False, out_dtype: torch.dtype | None = None,
                  bias: torch.Tensor | None = None, autotune: bool = True) -> torch.Tensor:
    """y = x @ W.T (+ bias) with float32 accumulation, rounded once to `out_dtype`
    (default float32). x: (M, K) float32/float16 (bf16 on sm_80+), on w's device.
    `invariant=True`: a fixed configuration, so each row's result is bitwise
    independent of M and of the other rows."""
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ConfigError(f"x for {w.name!r}", tuple(x.shape), f"expected (M, {k}) activations")
    if x.device != w.device:
        raise DeviceError(f"repacked_gemv({w.name!r}): x is on {x.device} but the weight is on {w.device}")
    if x.device.type != "cuda" and not (x.device.type == "cpu" and _interpreting()):
        raise DeviceError(f"repacked_gemv({w.name!r}) is a Triton GPU kernel and got {x.device} tensors; move "
                          f"them to a CUDA device (CPU tensors run only under TRITON_INTERPRET=1)")
    m = x.shape[0]
    from minivllm.kernels.triton import q8_gemv as q8

    if q8.enabled() and w.ggml_type in q8.Q8_TYPES:  # opt-in: int8 activations + dp4a (not measured yet)
        return q8.q8_gemv(x, w, out_dtype=out_dtype, bias=bias)
    out = torch.empty((m, n), dtype=out_dtype or torch.float32, device=x.device)
    if m == 0:
        return out
    names = _PLANE_ORDER[w.ggml_type]
    ptrs = [w.planes[nm] if nm is not None else w.qs for nm in names]
    has_bias = bias is not None
    args = (x, w.qs, *ptrs, bias if has_bias else out, out, m, n, x.stride(0), x.stride(1), out.stride(0))
    common = dict(N_GROUPS=k // 32, KIND=w.kind, T=w.words_per_group, RR=R, HAS_BIAS=has_bias)
    if m > 1 and not invariant and os.environ.get("MINIVLLM_GEMV_ROWS", "1") != "0":
        # Several rows: decode each weight field once for up to 8 of them.
        block_m = min(triton.next_power_of_2(m), 8)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, R),)
        # BLOCK_G from ptxas (sm_90 / sm_75, Q4_K and Q6_K): 8 rows x 16 groups ~136 / 128
        # registers, 4 x 32 ~106-128, no spills; larger tiles pass 190.
        _repacked_gemv_rows_kernel[grid](*args, **common, BLOCK_G=16 if block_m == 8 else 32, BLOCK_M=block_m,
                                         num_warps=4)
        return out
    grid = (m * triton.cdiv(n, R),)
    if invariant or _interpreting() or not autotune:
        _repacked_gemv_kernel[grid](*args, **common, **_FIXED)
    else:
        _repacked_gemv_tuned[grid](*args, **common)
    return out


class RepackedQuantizedWeight(QuantizedWeight):
    """A `QuantizedWeight` whose blocks live only in repacked form on the device.

    `raw` is rebuilt from the planes on access (a temporary, e.g. for the GEMM path's
    dequantization), so the device holds one copy of the weight, about the file's size.
    """

    def __init__(self, repacked: RepackedWeight):  # noqa: D107 (no dataclass __init__: raw is derived)
        self.repacked = repacked
        self.ggml_type = repacked.ggml_type
        self.shape = repacked.shape
        self.name = repacked.name

    @property
    def raw(self) -> torch.Tensor:  # type: ignore[override]
        return unpack_raw(self.repacked)

    @property
    def nbytes(self) -> int:
        return self.repacked.nbytes

    @property
    def device(self) -> torch.device:
        return self.repacked.device

    def __repr__(self) -> str:
        return f"RepackedQuantizedWeight({self.name!r}, {self.type_name}, shape={self.shape}, nbytes={self.nbytes})"

    __eq__ = object.__eq__
    __hash__ = object.__hash__
