"""The low-precision CPU GEMV packs ("lowp"): GGUF weights in a compact torch layout.

These round activations, scales and outputs to bf16 or f16, so they run only when the
user asked for that precision: `dtype="bfloat16"` on a CPU, or the kernel option
`cpu_gemv="lowp"` (see linear.py). A float32 model's GEMV is the float32 kernel in
cpu_gemv.cpp (or the dense float32 GEMM where that cannot be built).

Small-batch decode on a CPU is memory-bound: every token streams every weight from
DRAM, so bytes per weight set the speed. A float32 copy of a 4-bit model moves 8x the
bytes of the file. torch has two CPU kernels that read compact weights quickly
(measured in scripts/cpu_packed_microbench.py, AVX2, 2 threads):

  "int4pack-g32"  `_weight_int4pack_mm_for_cpu`: 4-bit quants in groups of 32 along K,
                  one (scale, zero) pair per group, w = (q - 8) * scale + zero. Fast only
                  with bfloat16 activations, scales and output (its float16/float32
                  variants are a scalar reference loop, ~10x slower).
  "f16" / "bf16"  a half-precision dense matrix: torch's M=1 half GEMV reads 2 bytes per
                  weight and accumulates in float32. Its M > 1 path loses to the
                  float32 BLAS from M=3-4 on, so `max_rows` is 2.

Which one a GGUF type gets, and how faithful it is to `QuantizedWeight.dequantize`:

  Q4_0, Q4_1, Q4_K -> int4pack-g32. Each 32-element group is affine in a 4-bit quant,
      which is exactly the kernel's form: Q4_0 scale = d, zero = 0; Q4_1 scale = d,
      zero = m + 8d; Q4_K scale = d*sc, zero = 8*d*sc - dmin*m (sub-blocks of 32).
      Rounding: scale and zero are stored as bf16 (relative error <= 2^-9 each), the
      activations are rounded to bf16 (<= 2^-9) and so is the output (<= 2^-9); the
      kernel accumulates in float32.
  Q8_0, Q5_0, Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, F16 -> f16 (bf16 if a weight would not fit
      in f16's range). None of these is a 4-bit group-32 affine code (5/6/8-bit quants,
      or 16-element sub-blocks), and torch's int8 kernel has one scale per row, which a
      per-block scale cannot map to. f16 is exact for F16 weights only: d * q of Q8_0
      needs up to 11 + 7 significant bits, so it is rounded to f16's 11 (relative error
      <= 2^-11); the same holds for the other k-/5-bit types. Activations are rounded
      to f16 (<= 2^-11), rescaled per row by a power of two first when they could
      overflow it, and so is the output.
  BF16 -> bf16 (exact weights; activations and output rounded to bf16).
  F32 -> None: nothing smaller is faithful, and f32 is what the caller already has.

So the int4 path is bf16-accurate (about 3 significant decimal digits per product),
the f16 path about 4x better; llama.cpp itself quantizes activations to 8 bits for its
CPU dot products, which is coarser than either.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from minivllm.gguf.dequant import k_scales_mins
from minivllm.kernels.quant_weight import QuantizedWeight

_T = GGMLQuantizationType

_GROUP = 32  # elements per (scale, zero) pair in the int4 format
# The int4 kernel wants N in whole tiles of 16 output features; other N are padded.
_N_MULTIPLE = 16
# Rows packed per call to torch's converter, which needs an int32 (rows, K) temporary
# (a 150k-row vocabulary would otherwise need a 0.5 GB int32 copy). A multiple of 64,
# torch's widest N tile, so the packed chunks concatenate into the whole-matrix layout.
_PACK_ROWS = 4096

# Largest magnitude an f16 GEMV may produce: f16's max finite value (65504) with
# headroom. An output is bounded by max|x| * sum|w| over its weight row, and rescaled
# activations are < 2 in magnitude; weights whose rows could exceed it go to bf16.
_F16_SAFE_OUTPUT = 32768.0


def packed_kind(w: QuantizedWeight) -> str | None:
    """The `kind` `CpuPackedWeight.from_quantized(w)` would give, without packing (an f16
    weight whose rows could overflow f16 turns out "bf16" once packed)."""
    if w.ggml_type in _INT4_GROUPS:
        return Int4PackedWeight.kind
    if w.ggml_type in _HALF_TYPES:
        return "bf16" if w.ggml_type == _T.BF16 else "f16"
    return None


class CpuPackedWeight:
    """An (N, K) GGUF weight in the fastest faithful layout torch's CPU kernels read.

    `matmul(x)` takes (M, K) float32 and returns (M, N) float32. `kind` names the
    layout (shown in snapshots/traces), `nbytes` the memory it holds, and `max_rows`
    the largest M for which it is known to beat a float32 GEMM on the dequantized
    matrix (callers should use the dense GEMM above it).
    """

    kind: str
    nbytes: int
    max_rows: int
    shape: tuple[int, int]
    name: str

    @classmethod
    def from_quantized(cls, w: QuantizedWeight) -> "CpuPackedWeight | None":
        """The packed form of `w`, or None when no representation beats float32 (F32)."""
        if w.device.type != "cpu":
            raise ValueError(
                f"CpuPackedWeight.from_quantized({w.name!r}): the weight is on {w.device}; "
                f"CPU packed weights are for CPU models only (CUDA uses the Triton GEMV)"
            )
        if w.ggml_type in _INT4_GROUPS:
            return Int4PackedWeight(w)
        if w.ggml_type in _HALF_TYPES:
            return HalfWeight(w)
        return None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _check_input(self, x: torch.Tensor) -> None:
        k = self.shape[1]
        if x.dim() != 2 or x.shape[1] != k or x.device.type != "cpu":
            raise ValueError(
                f"{self.name} ({self.kind}) multiplies (M, {k}) CPU activations; "
                f"got shape {tuple(x.shape)} on {x.device}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.kind}, shape={self.shape}, nbytes={self.nbytes})"


# --- int4, group 32 ---------------------------------------------------------------------


def _f16_at(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 at byte `at` of every block (n, bytes), as float32 (n, 1)."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles_low_then_high(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32) quants: low nibbles are elements 0-15, high ones 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0_groups(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # f16 d | 16 B nibbles; w = d * (q - 8): already the kernel's form with zero 0.
    d = _f16_at(b, 0)
    return _nibbles_low_then_high(b[:, 2:]), d, torch.zeros_like(d)


def _q4_1_groups(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # f16 d | f16 m | 16 B nibbles; w = d*q + m = d*(q - 8) + (m + 8d).
    d, m = _f16_at(b, 0), _f16_at(b, 2)
    return _nibbles_low_then_high(b[:, 4:]), d, m + 8 * d


def _q4_k_groups(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # f16 d | f16 dmin | 12 B 6-bit scales/mins | 128 B nibbles as 4 chunks of 32 bytes:
    # chunk j's low nibbles are sub-block 2j, its high nibbles sub-block 2j+1.
    # w = (d*sc)*q - dmin*m = (d*sc)*(q - 8) + (8*d*sc - dmin*m).
    n = b.shape[0]
    sc, mn = k_scales_mins(b[:, 4:16])
    scale = _f16_at(b, 0) * sc.float()  # (n, 8), exact in f32 (11 + 6 bits)
    minus = _f16_at(b, 2) * mn.float()
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(n * 8, 32)
    return q, scale.reshape(-1, 1), (8 * scale - minus).reshape(-1, 1)


# type -> (bytes per block, elements per block, block -> (q, scale, zero) per 32-group)
_INT4_GROUPS = {
    _T.Q4_0: (18, 32, _q4_0_groups),
    _T.Q4_1: (20, 32, _q4_1_groups),
    _T.Q4_K: (144, 256, _q4_k_groups),
}


class Int4PackedWeight(CpuPackedWeight):
    """Q4_0 / Q4_1 / Q4_K as torch's CPU int4 format: bf16 in, bf16 out."""

    kind = "int4pack-g32"
    # scripts/cpu_packed_microbench.py (AVX2, SmolLM2 shapes): faster than the float32
    # GEMM through M=16-24 on every shape, slower from M=32; the kernel re-reads the
    # weight for every 4 rows, so its cost grows linearly in M while the GEMM's doesn't.
    max_rows = 16

    def __init__(self, w: QuantizedWeight):
        n, k = w.shape
        type_size, block_size, groups_of = _INT4_GROUPS[w.ggml_type]
        self.shape, self.name = (n, k), w.name
        self.n_padded = -(-n // _N_MULTIPLE) * _N_MULTIPLE
        blocks = w.raw.reshape(n * k // block_size, type_size)
        q, scale, zero = groups_of(blocks)
        # Rows of padding (N not a multiple of 16) multiply as zeros: scale 0, zero 0.
        pad = self.n_padded - n
        q = torch.nn.functional.pad(q.reshape(n, k), (0, 0, 0, pad), value=8)
        scale = torch.nn.functional.pad(scale.reshape(n, k // _GROUP), (0, 0, 0, pad))
        zero = torch.nn.functional.pad(zero.reshape(n, k // _GROUP), (0, 0, 0, pad))
        # The kernel reads scales_and_zeros as (K/32, N, 2): group-major, then feature.
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
        self.packed = torch.cat([
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[r : r + _PACK_ROWS].to(torch.int32), 2)
            for r in range(0, self.n_padded, _PACK_ROWS)
        ])
        self.nbytes = self.packed.numel() + self.scales_zeros.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        xb = x.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, _GROUP, self.scales_zeros)
        if self.n_padded != self.shape[0]:
            y = y[:, : self.shape[0]]
        return y.float()


# --- half precision ---------------------------------------------------------------------

_HALF_TYPES = (
    _T.Q8_0, _T.Q5_0, _T.Q5_1, _T.Q2_K, _T.Q3_K, _T.Q5_K, _T.Q6_K, _T.F16, _T.BF16,
)  # fmt: skip


class HalfWeight(CpuPackedWeight):
    """The dequantized matrix in f16 (bf16 for BF16 files or out-of-range weights).

    f16 tops out at 65504. An output row is at most max|x| * (largest row sum of |w|),
    so when that bound is safe x goes straight to f16; otherwise each row of x is first
    divided by a power of two that brings it below 2 (exact: only the exponent changes)
    and the output multiplied back. Weights whose rows could overflow even then get bf16.
    """

    # torch's half matmul is a fast GEMV at M=1 (half the bytes of f32); above that it
    # is a plain loop that loses to the f32 BLAS from M=3-4 (M=2 still wins by ~1.7x).
    max_rows = 2

    def __init__(self, w: QuantizedWeight):
        self.shape, self.name = tuple(w.shape), w.name
        self.weight = w.dequantize(torch.bfloat16 if w.ggml_type == _T.BF16 else torch.float16)
        self.max_row_l1 = float(self.weight.abs().sum(dim=1, dtype=torch.float32).max())
        if self.weight.dtype == torch.float16 and not self.max_row_l1 * 2 < _F16_SAFE_OUTPUT:
            self.weight = w.dequantize(torch.bfloat16)
        self.kind = "f16" if self.weight.dtype == torch.float16 else "bf16"
        self.nbytes = self.weight.numel() * 2

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x = x.float()
        if self.weight.dtype == torch.bfloat16:
            return (x.to(torch.bfloat16) @ self.weight.T).float()
        # One reduction and a host comparison: cheaper than always rescaling (each extra
        # op costs microseconds, comparable to a small GEMV). NaN fails the test and takes
        # the rescaling path, which propagates it.
        amax = float(torch.linalg.vector_norm(x, float("inf")))
        if amax < _F16_SAFE_OUTPUT and amax * self.max_row_l1 < _F16_SAFE_OUTPUT:
            return (x.to(torch.float16) @ self.weight.T).float()
        # 2^floor(log2(max|row|)) by masking the float32 exponent bits: dividing by it
        # is exact and leaves every row below 2 in magnitude. The floor of 2^-100 keeps
        # an all-zero row from dividing by zero.
        row_max = x.abs().amax(dim=1, keepdim=True).clamp_min_(2.0**-100)
        pow2 = (row_max.view(torch.int32) & 0x7F800000).view(torch.float32)
        y = (x / pow2).to(torch.float16) @ self.weight.T
        return y.float().mul_(pow2)
