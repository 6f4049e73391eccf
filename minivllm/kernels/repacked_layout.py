"""A GPU-friendly repacking of GGUF blocks, built once at load (pure torch: the kernels
that read it are in `kernels/triton/repacked_gemv.py`).

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGMLQuantizationType

from minivllm.errors import ConfigError
from minivllm.gguf.dequant import bits_u32, k_scales_mins, unpack_fields
from minivllm.gguf.quant_types import SUPPORTED_TYPES
from minivllm.kernels.quant_weight import QuantizedWeight

_T = GGMLQuantizationType
R = 4  # rows interleaved per row group

# Kernel kinds (compile-time constants).
K_Q4_0, K_Q4_1, K_Q5_0, K_Q8_0, K_Q4_K, K_Q6_K = range(6)
_KIND = {_T.Q4_0: K_Q4_0, _T.Q4_1: K_Q4_1, _T.Q5_0: K_Q5_0, _T.Q8_0: K_Q8_0, _T.Q4_K: K_Q4_K, _T.Q6_K: K_Q6_K}
REPACKED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_KIND)
# The planes a kernel takes as its four plane pointers (a, b, c, e), per type; None: unused.
PLANE_ORDER = {
    "Q4_0": ("d", None, None, None), "Q4_1": ("d", "m", None, None), "Q5_0": ("d", "qh", None, None),
    "Q8_0": ("d", None, None, None), "Q4_K": ("d", "dmin", "sc", "mn"), "Q6_K": ("d", "qh", "sc_lo", "sc_hi"),
}


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


# --- row ranges: one weight for several projections of one input --------------------------


def concat_rows(parts: list[RepackedWeight], name: str) -> RepackedWeight:
    """The parts' rows one after another, as one weight (a layer's Q/K/V, its gate/up):
    same type and K, each part a whole number of row groups, so no padding row sits
    between them and `row_range` can give each part back as a view."""
    first = parts[0]
    k = first.shape[1]
    for p in parts:
        if p.ggml_type != first.ggml_type or p.shape[1] != k or p.shape[0] % R:
            raise ConfigError("concat_rows", p.name, f"parts must share type and K and have a multiple of {R} rows")
    n = sum(p.shape[0] for p in parts)
    planes = {nm: torch.cat([p.planes[nm] for p in parts]) for nm in first.planes}
    return RepackedWeight(first.ggml_type, (n, k), name, torch.cat([p.qs for p in parts]), planes)


def row_range(w: RepackedWeight, row0: int, n: int, name: str) -> RepackedWeight:
    """Rows row0 .. row0 + n of `w` as views of its planes (no copy); row0 and n whole row groups."""
    if row0 % R or n % R or row0 + n > w.shape[0]:
        raise ConfigError("row_range", (row0, n), f"rows must be whole groups of {R} inside {w.shape[0]}")
    nb0, nb = row0 // R, n // R
    return RepackedWeight(w.ggml_type, (n, w.shape[1]), name, w.qs[nb0:nb0 + nb],
                          {nm: a[nb0:nb0 + nb] for nm, a in w.planes.items()})


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
            codes = unpack_fields(b[:, 2:], 4).reshape(-1, 32)
            plane("d", _f16_field(b, 0))
        elif t == _T.Q4_1:
            codes = unpack_fields(b[:, 4:], 4).reshape(-1, 32)
            plane("d", _f16_field(b, 0))
            plane("m", _f16_field(b, 2))
        elif t == _T.Q5_0:
            lo = unpack_fields(b[:, 6:], 4).reshape(-1, 32)
            hi = bits_u32(b[:, 2:6])
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
        sc, mn = k_scales_mins(b[:, 4:16])  # (nsb, 8) uint8
        codes = unpack_fields(b[:, 16:].reshape(nsb, 4, 32), 4).reshape(nsb * 8, 32)
        plane("d", _f16_field(b, 0))
        plane("dmin", _f16_field(b, 2))
        plane("sc", sc.reshape(-1).contiguous())
        plane("mn", mn.reshape(-1).contiguous())
        qs = _interleave(_pack_fields(codes, 4).reshape(n, g, 4), n)
    else:  # Q6_K
        nsb = b.shape[0]
        lo = unpack_fields(b[:, :128].reshape(nsb, 2, 64), 4).reshape(nsb * 8, 32)
        hi = unpack_fields(b[:, 128:192].reshape(nsb, 2, 32), 2).reshape(nsb * 8, 32)
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

    def f16(name):  # 1-D first: an (n, 1) plane (K = 256, one super-block a row) may keep a stride of R
        return pl[name].reshape(-1).contiguous().view(torch.uint8).reshape(-1, 2)

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
