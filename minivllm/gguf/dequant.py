"""GGUF tensor bytes -> torch tensor, on whatever device the bytes already live.

The results are bit-identical (in float32) to `gguf.quants.dequantize`, which follows
ggml's C reference: every scale is widened from f16 to f32 first, the per-sub-block
scale `d * sc` is formed in f32 *before* it meets the quant, and an offset is applied
as a separate subtraction/addition afterwards (never fused). Each function below keeps
that order of operations; changing it changes the last bit of some weights.

Everything is torch ops over all blocks of a chunk at once, so the same code runs on
CPU and CUDA. Block layouts are little-endian C structs (see ggml-common.h); the
comment on each function gives the byte layout of one block.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from gguf import GGMLQuantizationType

from minivllm.errors import GGUFFormatError, UnsupportedTensorTypeError
from minivllm.gguf.quant_types import SUPPORTED_NAMES, SUPPORTED_TYPES, type_name

_T = GGMLQuantizationType
_QK_K = 256  # elements in a k-quant super-block

# Blocks are dequantized in chunks of about this many elements so the uint8/float
# temporaries of a 500M-element embedding stay at tens of MB, not many GB (and on CPU
# the chunks stay closer to cache; smaller chunks stop paying off below ~64k).
_CHUNK_ELEMENTS = 1 << 22

_FLOAT_DTYPES = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}


# --- bit-unpacking helpers -------------------------------------------------------------


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 stored at byte `at` of every block, as float32 of shape (n, 1)."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def unpack_fields(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Split every byte of `x` (..., k) into its 8//bits fields: (..., 8//bits, k).

    Field j holds bits [j*bits, (j+1)*bits) of each byte, lowest field first. ggml
    packs quants "strided": field j of byte i is element j*k + i of the group, so a
    plain reshape of the result gives elements in order.
    """
    shifts = _shifts(bits, x.device)
    return (x.unsqueeze(-2) >> shifts.view(-1, 1)) & ((1 << bits) - 1)


_SHIFTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    # Made once per device: a host-to-device copy inside every call would also make
    # dequantization impossible to capture in a CUDA graph.
    key = (bits, device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
    return _SHIFTS[key]


def bits_u32(x: torch.Tensor) -> torch.Tensor:
    """The 32 bits of a little-endian u32 stored as 4 bytes (n, 4): (n, 32), bit i at i.

    Unpacked bytewise because the u32 sits at an offset a uint32 view cannot reach.
    """
    return unpack_fields(x, 1).transpose(-1, -2).reshape(x.shape[0], 32)


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins packed into 12 bytes.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes
    4-7 the same for the mins; bytes 8-11 the low nibbles of scales 4-7 (low half)
    and mins 4-7 (high half).
    """
    s = scales.reshape(-1, 3, 4)
    lo_sc, lo_mn, packed = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 2) & 0x30)], dim=-1)
    mn = torch.cat([lo_mn & 0x3F, (packed >> 4) | ((lo_mn >> 2) & 0x30)], dim=-1)
    return sc, mn


# --- legacy 32-element blocks ----------------------------------------------------------
# Each takes (n_blocks, type_size) uint8 and returns n_blocks * block_size float32
# values in element order (any shape).


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # f16 d | 16 B nibbles. x = d * (q - 8)
    q = unpack_fields(b[:, 2:], 4).reshape(b.shape[0], 32).float().sub_(8)
    return q.mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # f16 d | f16 m | 16 B nibbles. x = d * q + m
    q = unpack_fields(b[:, 4:], 4).reshape(b.shape[0], 32).float()
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    # f16 d | u32 qh (5th bit of element i = bit i) | 16 B nibbles. x = d * (q - 16)
    lo = unpack_fields(b[:, 6:], 4).reshape(b.shape[0], 32)
    q = (lo | (bits_u32(b[:, 2:6]) << 4)).float().sub_(16)
    return q.mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    # f16 d | f16 m | u32 qh | 16 B nibbles. x = d * q + m
    lo = unpack_fields(b[:, 8:], 4).reshape(b.shape[0], 32)
    q = (lo | (bits_u32(b[:, 4:8]) << 4)).float()
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # f16 d | 32 x int8. x = d * q
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


# --- k-quants: 256-element super-blocks of 16 or 8 sub-blocks ----------------------------


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # 16 B scales (low nibble: scale, high nibble: min, per 16 elements) | 64 B 2-bit
    # quants | f16 d | f16 dmin. x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    sc = b[:, :16]
    dl = (_f16(b, 80) * (sc & 0x0F).float()).unsqueeze(-1)
    ml = (_f16(b, 82) * (sc >> 4).float()).unsqueeze(-1)
    q = unpack_fields(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 16, 16).float()
    return q.mul_(dl).sub_(ml)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # 32 B hmask | 64 B low 2 bits | 12 B 6-bit scales | f16 d. x = (d * (sc - 32)) * q
    # where q = low2 - 4 when the hmask bit is *clear* (set means no offset).
    n = b.shape[0]
    scales = b[:, 96:108]
    # bytes 0-7: low nibbles of scales 0-7 then 8-15; bytes 8-11: their top 2 bits.
    lo = unpack_fields(scales[:, :8], 4).reshape(n, 16)
    hi = unpack_fields(scales[:, 8:], 2).reshape(n, 16)
    dl = (_f16(b, 108) * (lo | (hi << 4)).float().sub_(32)).unsqueeze(-1)
    low2 = unpack_fields(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 16, 16)
    hbit = unpack_fields(b[:, :32].reshape(n, 1, 32), 1).reshape(n, 16, 16)
    q = low2.float().sub_(((hbit ^ 1) << 2).float())
    return q.mul_(dl)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # f16 d | f16 dmin | 12 B packed scales/mins | 128 B nibbles (8 sub-blocks of 32).
    # x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    sc, mn = k_scales_mins(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    ml = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    q = unpack_fields(b[:, 16:].reshape(n, 4, 32), 4).reshape(n, 8, 32).float()
    return q.mul_(dl).sub_(ml)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    # f16 d | f16 dmin | 12 B scales/mins | 32 B high bits (bit j -> sub-block j) |
    # 128 B nibbles. x = (d * sc) * q - (dmin * m)
    n = b.shape[0]
    sc, mn = k_scales_mins(b[:, 4:16])
    dl = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    ml = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    lo = unpack_fields(b[:, 48:].reshape(n, 4, 32), 4).reshape(n, 8, 32)
    hi = unpack_fields(b[:, 16:48].reshape(n, 1, 32), 1).reshape(n, 8, 32)
    q = (lo | (hi << 4)).float()
    return q.mul_(dl).sub_(ml)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # 128 B low nibbles | 64 B high 2 bits | 16 x int8 scales | f16 d.
    # x = (d * sc) * (q - 32), 16 sub-blocks of 16.
    n = b.shape[0]
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    lo = unpack_fields(b[:, :128].reshape(n, 2, 64), 4).reshape(n, 8, 32)
    hi = unpack_fields(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 8, 32)
    q = (lo | (hi << 4)).float().sub_(32).reshape(n, 16, 16)
    return q.mul_(dl)


_DEQUANT: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    _T.Q4_0: _q4_0,
    _T.Q4_1: _q4_1,
    _T.Q5_0: _q5_0,
    _T.Q5_1: _q5_1,
    _T.Q8_0: _q8_0,
    _T.Q2_K: _q2_k,
    _T.Q3_K: _q3_k,
    _T.Q4_K: _q4_k,
    _T.Q5_K: _q5_k,
    _T.Q6_K: _q6_k,
}
assert set(_DEQUANT) | set(_FLOAT_DTYPES) == set(SUPPORTED_TYPES)


# --- entry point -----------------------------------------------------------------------


def dequantize(
    raw: torch.Tensor,
    ggml_type: GGMLQuantizationType | int,
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    tensor_name: str = "<tensor>",
) -> torch.Tensor:
    """Decode one GGUF tensor's bytes into a `dtype` tensor of `shape` on `raw.device`.

    `raw` is the tensor's data exactly as stored in the file (1-D uint8, blocks back to
    back); `shape` is in torch order, its last dimension the contiguous one. Values are
    computed in float32 (bit-exact with `gguf.quants.dequantize`) and then rounded to
    `dtype`.

    For F32/F16/BF16 data whose type already equals `dtype`, the result is a view of
    `raw` (no copy): clone it if `raw` is a read-only memory map you intend to write to.
    """
    try:
        qt = SUPPORTED_TYPES[GGMLQuantizationType(int(ggml_type))]
    except (ValueError, KeyError):
        raise UnsupportedTensorTypeError(tensor_name, type_name(ggml_type), SUPPORTED_NAMES) from None
    if raw.dtype != torch.uint8 or raw.dim() != 1:
        raise TypeError(
            f"dequantize({tensor_name!r}) wants the raw bytes as a 1-D uint8 tensor, "
            f"got dtype {raw.dtype} with shape {tuple(raw.shape)}"
        )

    shape = tuple(int(s) for s in shape)
    if not shape or shape[-1] % qt.block_size:
        raise GGUFFormatError(
            f"tensor {tensor_name!r} ({qt.name}) has shape {shape}: its last dimension must "
            f"be a multiple of the {qt.name} block size {qt.block_size}; the file is corrupt"
        )
    n_elements = math.prod(shape)
    n_blocks = n_elements // qt.block_size
    expected = n_blocks * qt.type_size
    if raw.numel() != expected:
        raise GGUFFormatError(
            f"tensor {tensor_name!r} ({qt.name}, shape {shape}) should be {expected} bytes "
            f"but {raw.numel()} bytes were given; the file is truncated or corrupt"
        )

    if qt.ggml_type in _FLOAT_DTYPES:
        raw = raw.contiguous()
        try:
            values = raw.view(_FLOAT_DTYPES[qt.ggml_type])
        except RuntimeError:  # storage offset not aligned to the element size
            values = raw.clone().view(_FLOAT_DTYPES[qt.ggml_type])
        # f16/bf16 -> f32 is exact, so converting straight to `dtype` rounds only once,
        # exactly as going through float32 would.
        return values.to(dtype).view(shape)

    fn = _DEQUANT[qt.ggml_type]
    blocks = raw.view(n_blocks, qt.type_size)
    step = max(1, _CHUNK_ELEMENTS // qt.block_size)
    if n_blocks <= step:
        return fn(blocks).to(dtype).view(shape)
    out = torch.empty(n_elements, dtype=dtype, device=raw.device)
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        out[start * qt.block_size : stop * qt.block_size] = fn(blocks[start:stop]).view(-1)
    return out.view(shape)
