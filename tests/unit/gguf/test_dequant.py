"""`minivllm.gguf.dequant.dequantize` against gguf's numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gq

from minivllm.errors import GGUFFormatError, UnsupportedTensorTypeError
from minivllm.gguf.dequant import dequantize
from minivllm.gguf.quant_types import SUPPORTED_TYPES, row_nbytes

T = GGMLQuantizationType

# Byte offsets of the f16 scale fields in one block, and whether they are super-block
# scales that real files keep positive (k-quant d/dmin) or signed (legacy d, min).
F16_FIELDS: dict[GGMLQuantizationType, tuple[list[int], bool]] = {
    T.Q4_0: ([0], False),
    T.Q4_1: ([0, 2], False),
    T.Q5_0: ([0], False),
    T.Q5_1: ([0, 2], False),
    T.Q8_0: ([0], False),
    T.Q2_K: ([80, 82], True),
    T.Q3_K: ([108], True),
    T.Q4_K: ([0, 2], True),
    T.Q5_K: ([0, 2], True),
    T.Q6_K: ([208], True),
}
FLOAT_TYPES = [T.F32, T.F16, T.BF16]
QUANT_TYPES = list(F16_FIELDS)
ALL_TYPES = FLOAT_TYPES + QUANT_TYPES


def _shape(qtype: GGMLQuantizationType) -> tuple[int, ...]:
    return (2, 64) if GGML_QUANT_SIZES[qtype][0] == 32 else (3, 512)


def _random_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int,
                  any_finite: bool = False) -> np.ndarray:
    """Valid random data: random quant bytes, finite f16 scales (never NaN/Inf)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if qtype == T.F32:
        return rng.uniform(-4, 4, n).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.uniform(-4, 4, n).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        bits = rng.uniform(-4, 4, n).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n // block_size, type_size), dtype=np.uint8)
    offsets, positive = F16_FIELDS[qtype]
    for off in offsets:
        if any_finite:  # every finite f16 bit pattern, subnormals and 65504 included
            bits = rng.integers(0, 1 << 16, len(blocks), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent 31 -> 15: finite
            vals = bits.view(np.float16)
        elif positive:
            vals = rng.uniform(0, 0.05, len(blocks)).astype(np.float16)
        else:
            vals = rng.uniform(-2, 2, len(blocks)).astype(np.float16)
        assert np.isfinite(vals).all()
        blocks[:, off : off + 2] = vals.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def _reference(data: np.ndarray, qtype: GGMLQuantizationType, shape) -> torch.Tensor:
    rows = data.reshape(int(np.prod(shape[:-1])), -1)
    ref = gq.dequantize(rows, qtype).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(ref)).reshape(shape)


def _check(data: np.ndarray, qtype: GGMLQuantizationType, shape, device: str = "cpu") -> None:
    raw = torch.from_numpy(data.copy()).to(device)
    out = dequantize(raw, qtype, shape, tensor_name="t")
    assert out.device.type == torch.device(device).type
    assert out.dtype == torch.float32 and out.shape == shape
    ref = _reference(data, qtype, shape)
    got = out.cpu()
    if not torch.equal(got, ref):
        bad = (got != ref).nonzero()[:5].tolist()
        pytest.fail(f"{qtype.name} on {device}: mismatch at {bad}: "
                    f"{[got[tuple(i)].item() for i in bad]} vs {[ref[tuple(i)].item() for i in bad]}")


def test_table_matches_gguf():
    assert {t.name for t in SUPPORTED_TYPES} == {t.name for t in ALL_TYPES}
    for t, qt in SUPPORTED_TYPES.items():
        assert (qt.block_size, qt.type_size) == GGML_QUANT_SIZES[t]
        assert qt.name == t.name
    assert row_nbytes(T.Q4_K, 512) == 2 * 144
    assert row_nbytes(int(T.Q8_0), 64) == 2 * 34
    assert row_nbytes(T.F16, 7) == 14
    with pytest.raises(GGUFFormatError):
        row_nbytes(T.Q4_0, 33)
    with pytest.raises(KeyError):
        row_nbytes(T.IQ2_XXS, 256)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_blocks_match_gguf(qtype, seed):
    shape = _shape(qtype)
    _check(_random_bytes(qtype, shape, seed), qtype, shape)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_any_finite_scale_matches_gguf(qtype):
    # Extreme and subnormal scales: the order of the f32 ops decides the last bit here.
    shape = (4, 1024)
    _check(_random_bytes(qtype, shape, seed=7, any_finite=True), qtype, shape)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0],
                         ids=lambda t: t.name)
def test_gguf_quantized_data_matches_gguf(qtype):
    rng = np.random.default_rng(42)
    shape = (4, 256)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (d == 0)
    data = np.ascontiguousarray(gq.quantize(x, qtype)).view(np.uint8).reshape(-1)
    _check(data, qtype, shape)


def test_higher_rank_shape():
    shape = (2, 3, 64)
    _check(_random_bytes(T.Q8_0, shape, seed=3), T.Q8_0, shape)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q4_K, T.Q6_K, T.Q5_1], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_output_dtype(qtype, dtype):
    shape = _shape(qtype)
    raw = torch.from_numpy(_random_bytes(qtype, shape, seed=5))
    f32 = dequantize(raw, qtype, shape)
    out = dequantize(raw, qtype, shape, dtype=dtype)
    assert out.dtype == dtype and out.shape == shape
    assert torch.equal(out, f32.to(dtype))


def test_chunked_path_matches(monkeypatch):
    import minivllm.gguf.dequant as dq

    shape = (8, 512)
    raw = torch.from_numpy(_random_bytes(T.Q4_K, shape, seed=9))
    whole = dequantize(raw, T.Q4_K, shape)
    monkeypatch.setattr(dq, "_CHUNK_ELEMENTS", 3 * 256)  # 3 blocks per chunk, ragged tail
    assert torch.equal(dequantize(raw, T.Q4_K, shape), whole)
    assert torch.equal(dequantize(raw, T.Q4_K, shape, dtype=torch.float16), whole.half())


def test_unaligned_float_bytes():
    data = _random_bytes(T.F32, (2, 8), seed=1)
    buf = torch.zeros(data.size + 2, dtype=torch.uint8)
    buf[2:] = torch.from_numpy(data)
    assert torch.equal(dequantize(buf[2:], T.F32, (2, 8)), _reference(data, T.F32, (2, 8)))


@pytest.mark.parametrize("bad", ["IQ2_XXS", "Q8_1", "Q8_K", "IQ4_NL"])
def test_unsupported_type(bad):
    if not hasattr(T, bad):
        pytest.skip(f"gguf has no {bad}")
    qtype = T[bad]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = torch.zeros(type_size, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorTypeError) as exc:
        dequantize(raw, qtype, (block_size,), tensor_name="blk.0.attn_q.weight")
    assert "blk.0.attn_q.weight" in str(exc.value)
    assert bad in str(exc.value)
    with pytest.raises(UnsupportedTensorTypeError, match="blk.0.attn_q.weight"):
        dequantize(raw, int(qtype), (block_size,), tensor_name="blk.0.attn_q.weight")


def test_unknown_type_id():
    with pytest.raises(UnsupportedTensorTypeError, match="type9999"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 9999, (1,), tensor_name="w")


def test_wrong_byte_count():
    raw = torch.zeros(2 * 34 - 1, dtype=torch.uint8)
    with pytest.raises(GGUFFormatError) as exc:
        dequantize(raw, T.Q8_0, (2, 32), tensor_name="output.weight")
    msg = str(exc.value)
    assert "output.weight" in msg and "68" in msg and "67" in msg


def test_partial_block_shape():
    with pytest.raises(GGUFFormatError, match="block size"):
        dequantize(torch.zeros(34, dtype=torch.uint8), T.Q8_0, (1, 33), tensor_name="w")


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_cuda_matches_gguf(qtype, monkeypatch):
    import minivllm.gguf.dequant as dq

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    shape = _shape(qtype)
    _check(_random_bytes(qtype, shape, seed=11), qtype, shape, device="cuda")
    if qtype in F16_FIELDS:
        _check(_random_bytes(qtype, (4, 1024), seed=12, any_finite=True), qtype, (4, 1024), "cuda")
    # A multi-chunk tensor exercises the chunk loop on the device as well.
    monkeypatch.setattr(dq, "_CHUNK_ELEMENTS", 1 << 16)
    big = (64, 4096)
    _check(_random_bytes(qtype, big, seed=13), qtype, big, device="cuda")
