"""CpuPackedWeight.matmul against the independent reference x @ dequantize(float32).T.

The reference is minivllm's torch dequantization (bit-exact with gguf.quants, see
test_dequant.py) multiplied in float64. The packed paths round in known places, so
every tolerance below is an error bound derived from those roundings, elementwise:

  int4pack-g32 (u = 2^-9, bf16): scale and zero are stored in bf16, so a weight is off
      by at most u * (8|scale| + |zero|) <= u * 3G, where G is the largest |w| of its
      32-element group (8|scale| spans half the group's 16 levels <= 2G, and the zero
      is the value at level 8, inside the group's range); activations rounded to bf16
      add u|x||w|, the bf16 output u|y|.
  f16 (u = 2^-11) / bf16 (u = 2^-9) dense: weight u|w|, activation u|x||w|, output u|y|.

Float32 accumulation error (K * 2^-24 relative) is far below these and covered by the
slack factor. A wrong nibble order, zero or scale gives errors of order |x||w|, i.e.
hundreds of times the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from minivllm.gguf.reader import GGUFFile
from minivllm.kernels.cpu_packed import CpuPackedWeight
from minivllm.kernels.quant_weight import QuantizedWeight

T = GGMLQuantizationType
U_BF16 = 2.0**-9
U_F16 = 2.0**-11
SLACK = 1.25  # second-order terms and f32 accumulation, well below 25% of the bound

INT4_TYPES = [T.Q4_0, T.Q4_1, T.Q4_K]
HALF_TYPES = [T.Q8_0, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q5_K, T.Q6_K, T.F16]

# Byte offsets of each block's f16 scale fields (see ggml-common.h).
_F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}  # fmt: skip


def _random_weight(qtype: GGMLQuantizationType, n: int, k: int, seed: int, scale: float = 0.01) -> QuantizedWeight:
    """Random valid blocks: random quant bytes, f16 scales of LLM-like size in +-`scale`."""
    rng = np.random.default_rng(seed)
    if qtype in (T.F16, T.BF16):
        vals = rng.normal(0, 0.05, (n, k)).astype(np.float32)
        raw = torch.from_numpy(vals).to(torch.float16 if qtype == T.F16 else torch.bfloat16)
        return QuantizedWeight(raw.view(torch.uint8), qtype, (n, k), f"rand-{qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        d = rng.uniform(-scale, scale, len(blocks)).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return QuantizedWeight(torch.from_numpy(blocks.reshape(n, -1)), qtype, (n, k), f"rand-{qtype.name}")


def _assert_within_bound(packed: CpuPackedWeight, w: QuantizedWeight, x: torch.Tensor) -> None:
    W = w.dequantize(torch.float32).double()
    xd = x.double()
    ref = xd @ W.T
    y = packed.matmul(x)
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    absW, absx = W.abs(), xd.abs()
    if packed.kind == "int4pack-g32":
        u = U_BF16
        group_max = absW.reshape(W.shape[0], -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(W.shape)
        bound = u * (absx @ (absW + 3 * group_max).T + ref.abs())
    else:
        u = U_F16 if packed.kind == "f16" else U_BF16
        bound = u * (2 * absx @ absW.T + ref.abs())
    err = (y.double() - ref).abs()
    worst = (err / (SLACK * bound + 1e-30)).max().item()
    assert worst <= 1.0, f"{w.name} {packed.kind}: error reaches {worst:.2f}x the rounding bound"


@pytest.mark.parametrize("qtype", INT4_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_int4_types_match_dequant_reference(qtype, rows):
    # N = 72 is not a multiple of the kernel's 16-feature tile: exercises the padding.
    w = _random_weight(qtype, 72, 512, seed=rows)
    packed = CpuPackedWeight.from_quantized(w)
    assert packed.kind == "int4pack-g32"
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    _assert_within_bound(packed, w, x)


@pytest.mark.parametrize("qtype", HALF_TYPES)
@pytest.mark.parametrize("rows", [1, 4])
def test_other_types_match_dequant_reference(qtype, rows):
    w = _random_weight(qtype, 40, 512, seed=rows)
    packed = CpuPackedWeight.from_quantized(w)
    assert packed.kind == "f16"
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    _assert_within_bound(packed, w, x)


def test_bf16_weights_stay_exact():
    w = _random_weight(T.BF16, 32, 256, seed=0)
    packed = CpuPackedWeight.from_quantized(w)
    assert packed.kind == "bf16"
    assert torch.equal(packed.weight.float(), w.dequantize(torch.float32))
    _assert_within_bound(packed, w, torch.randn(2, 256))


def test_f16_weights_stay_exact():
    w = _random_weight(T.F16, 32, 256, seed=0)
    packed = CpuPackedWeight.from_quantized(w)
    assert torch.equal(packed.weight.float(), w.dequantize(torch.float32))


def test_int4_scales_reproduce_gguf_values_up_to_bf16():
    """The packed (q, scale, zero) decode to the GGUF weights: multiply the identity."""
    for qtype in INT4_TYPES:
        w = _random_weight(qtype, 32, 256, seed=5)
        packed = CpuPackedWeight.from_quantized(w)
        # bf16 inputs of 0/1 and a single nonzero product per output: y[j, i] = w[i, j]
        # rounded to bf16 at the output, plus the bf16 scale/zero error.
        got = packed.matmul(torch.eye(256)).T.double()
        W = w.dequantize(torch.float32).double()
        gmax = W.abs().reshape(32, -1, 32).amax(-1, keepdim=True).expand(-1, -1, 32).reshape(W.shape)
        assert ((got - W).abs() <= SLACK * U_BF16 * (3 * gmax + W.abs())).all(), qtype.name


def test_large_activations_do_not_overflow_f16():
    # 1e6 is far beyond f16's 65504: without the per-row rescale this gives inf.
    w = _random_weight(T.Q8_0, 32, 256, seed=1)
    packed = CpuPackedWeight.from_quantized(w)
    assert packed.kind == "f16"
    x = torch.randn(3, 256) * torch.tensor([[1e6], [1.0], [1e-6]])
    _assert_within_bound(packed, w, x)
    assert torch.isfinite(packed.matmul(torch.zeros(1, 256))).all()


def test_weights_that_could_overflow_f16_use_bf16():
    # Q8_0 with d = 60: weights up to 7620, rows of 256 sum far past f16's range.
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (32 * 8, 34), dtype=np.uint8)
    blocks[:, 0:2] = np.full(len(blocks), 60.0, np.float16).view(np.uint8).reshape(-1, 2)
    w = QuantizedWeight(torch.from_numpy(blocks.reshape(32, -1)), T.Q8_0, (32, 256), "big")
    packed = CpuPackedWeight.from_quantized(w)
    assert packed.kind == "bf16"
    _assert_within_bound(packed, w, torch.randn(2, 256))


def test_packing_in_chunks_concatenates_correctly():
    # More rows than one converter call takes (4096), and not a multiple of 64.
    w = _random_weight(T.Q4_0, 4096 + 48, 64, seed=3)
    packed = CpuPackedWeight.from_quantized(w)
    _assert_within_bound(packed, w, torch.randn(2, 64))


def test_nbytes_is_the_packed_size():
    w = _random_weight(T.Q4_1, 64, 512, seed=0)
    packed = CpuPackedWeight.from_quantized(w)
    # 4 bits per weight + a bf16 (scale, zero) pair per 32 weights: 5 bits per weight.
    assert packed.nbytes == 64 * 512 // 2 + 64 * 512 // 32 * 4
    assert CpuPackedWeight.from_quantized(_random_weight(T.Q8_0, 64, 512, seed=0)).nbytes == 64 * 512 * 2


def test_f32_weights_return_none():
    raw = torch.randn(16, 64).view(torch.uint8)
    assert CpuPackedWeight.from_quantized(QuantizedWeight(raw, T.F32, (16, 64), "f32")) is None


def test_wrong_input_shape_names_the_weight():
    packed = CpuPackedWeight.from_quantized(_random_weight(T.Q4_0, 16, 64, seed=0))
    with pytest.raises(ValueError, match=r"rand-Q4_0 .*\(M, 64\).*\(2, 32\)"):
        packed.matmul(torch.randn(2, 32))


def test_non_cpu_weight_is_refused():
    w = _random_weight(T.Q4_0, 16, 64, seed=0)
    w.raw = w.raw.to("meta")
    with pytest.raises(ValueError, match="CPU packed weights are for CPU models"):
        CpuPackedWeight.from_quantized(w)


# --- real model tensors -----------------------------------------------------------------


def _real(path, name: str) -> QuantizedWeight:
    f = GGUFFile(path)
    info = f.tensor_info(name)
    return QuantizedWeight(f.tensor_bytes(name), info.ggml_type, tuple(info.shape), name)


@pytest.mark.parametrize("name, kind", [
    ("blk.0.attn_q.weight", "int4pack-g32"),   # Q4_1 576x576
    ("blk.0.attn_k.weight", "int4pack-g32"),   # Q4_1 192x576
    ("blk.5.ffn_down.weight", "int4pack-g32"), # Q4_1 576x1536
    ("token_embd.weight", "f16"),              # Q8_0 49152x576, the tied LM head
])  # fmt: skip
def test_smollm2_tensors(smollm2_path, name, kind):
    w = _real(smollm2_path, name)
    packed = CpuPackedWeight.from_quantized(w)
    assert packed.kind == kind
    _assert_within_bound(packed, w, torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0)))


@pytest.mark.parametrize("name, type_name, kind", [
    ("blk.0.ffn_gate.weight", "Q5_0", "f16"),
    ("blk.0.attn_v.weight", "Q8_0", "f16"),
    ("blk.0.ffn_down.weight", "Q6_K", "f16"),
    ("blk.11.ffn_down.weight", "Q4_K", "int4pack-g32"),
])  # fmt: skip
def test_qwen05_tensors(qwen05_path, name, type_name, kind):
    w = _real(qwen05_path, name)
    assert w.type_name == type_name
    packed = CpuPackedWeight.from_quantized(w)
    assert packed.kind == kind
    _assert_within_bound(packed, w, torch.randn(2, w.shape[1], generator=torch.Generator().manual_seed(0)))
