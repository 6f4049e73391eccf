"""The int8-activation CPU GEMV (kernels/cpu_gemv_q8.cpp), the fast mode's kernel.

Reference, computed independently here in float64: the activations quantized per block
of 32 as the mode defines it (scale = max|a| / 127 in float32, q = round-half-even(a /
scale)), times minivllm's torch dequantization of the weights (bit-exact with
gguf.quants, test_dequant.py). The kernel sums each block's products exactly in int32,
so what remains is float32 rounding of the per-block scale products and their sum:
|error| <= 4 * nblocks * 2^-24 * sum_b |d_b s_b I_b| (+ the offset terms), far below the
int8 rounding it stands for. A wrong nibble, bit, offset or block order gives errors
of the order of the result itself.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from test_cpu_gemv import needs_ext
from test_cpu_packed import _random_weight

from minivllm import LLM, SamplingParams
from minivllm.kernels import cpu_gemv

T = GGMLQuantizationType
PACKED = [T.Q4_0, T.Q4_1, T.Q5_0]
U_F32 = 2.0**-24


def _has_packed() -> bool:
    ext = cpu_gemv.extension()
    return ext is not None and ext.has_packed_q8()


needs_packed = pytest.mark.skipif(not _has_packed(), reason="no AVX512-VNNI here: q8 falls back to the f32 kernel")


def _q8_reference(x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """(x quantized as the q8 mode defines it, in float64) @ W.T, and the error bound."""
    m, k = x.shape
    blocks = x.view(m, k // 32, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127.0).double()  # float32 division, as the kernel
    q = torch.where(scale > 0, torch.round(blocks.double() / torch.where(scale > 0, scale, 1.0)), 0.0)
    xq = (q * scale).view(m, k)
    W = w.dequantize(torch.float32).double()
    ref = xq @ W.T
    bound = 4 * (k // 32) * U_F32 * (xq.abs() @ W.abs().T) + 1e-30
    return ref, bound


@needs_ext
@needs_packed
@pytest.mark.parametrize("qtype", PACKED)
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("k", [544, 576, 1536])  # 17 blocks (odd: the padded pair), 18, 48 (three scale groups)
def test_packed_kernel_matches_the_q8_reference(qtype, rows, k):
    w = _random_weight(qtype, 40, k, seed=rows + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    y = cpu_gemv.run_q8_packed(x, [cpu_gemv.pack_q8(w)], [int(qtype)], [40])[0]
    ref, bound = _q8_reference(x, w)
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"{qtype.name} k={k} rows={rows}: {float((err / bound).max()):.1f}x the bound"


@needs_ext
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0])
def test_portable_kernel_matches_the_q8_reference(qtype):
    """gemv_q8 on the file's blocks (the kernel for builds without AVX512-VNNI)."""
    w = _random_weight(qtype, 24, 544, seed=5)
    x = torch.randn(3, 544, generator=torch.Generator().manual_seed(5))
    y = cpu_gemv.run_q8(x, cpu_gemv.prepare([w]))[0]
    ref, bound = _q8_reference(x, w)
    assert ((y.double() - ref).abs() <= bound).all()


@needs_ext
@needs_packed
@pytest.mark.parametrize("qtype", PACKED)
def test_rows_are_bitwise_independent_of_the_batch(qtype):
    """Each row is quantized and summed alone (the M = 1 loop and the batched loop use one
    order), so the fast mode stays batch-invariant like the f32 kernel."""
    w = _random_weight(qtype, 33, 576, seed=9)
    pack = cpu_gemv.pack_q8(w)
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(9))
    together = cpu_gemv.run_q8_packed(x, [pack], [int(qtype)], [33])[0]
    for i in range(6):
        assert torch.equal(cpu_gemv.run_q8_packed(x[i:i + 1], [pack], [int(qtype)], [33])[0][0], together[i])


@needs_ext
def test_the_fast_mode_is_chosen_by_name_only(smollm2_path):
    """float32 keeps the float32 kernel; dtype=bfloat16 (or cpu_gemv="q8") selects q8 for the
    nibble types Q4_0/Q4_1/Q5_0, and the snapshot says which kernel each weight ran."""
    prompt = "The capital of France is"
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    exact = LLM(str(smollm2_path), device="cpu", dtype="float32", progress=False)
    exact.generate([prompt], sp)
    kinds = exact.engine.snapshot()["kernels"]["gemv_kinds"]
    assert not any("q8" in k for k in kinds), kinds
    for fast in (exact.fork(cpu_gemv="q8"), LLM(str(smollm2_path), device="cpu", dtype="bfloat16", progress=False)):
        fast.generate([prompt], sp)
        kinds = fast.engine.snapshot()["kernels"]["gemv_kinds"]
        # SmolLM2's 210 Q4_1 projections (packed or portable kernel); its Q8_0 LM head keeps float32.
        assert kinds.get(f"cpu-q8-{cpu_gemv.isa()}", 0) == 210 and kinds.get(f"cpu-f32-{cpu_gemv.isa()}") == 1, kinds


@needs_ext
def test_fast_mode_greedy_agrees_with_float32_until_a_near_tie(smollm2_path):
    """Int8 activations move each logit by about 1%, so greedy tokens may change only where
    float32's top two were close: the first split, if any, is at a position whose float32
    margin is small, and the logits before it stay within the int8 rounding's reach."""
    from minivllm.debug import compare

    report = compare(str(smollm2_path), "Once upon a time, in a small village by the sea,", a={"cpu_gemv": "f32"},
                     b={"cpu_gemv": "q8"}, max_tokens=48, hidden_states=False)
    agreed = report.records[:report.first_divergence.position] if report.first_divergence else report.records
    assert len(agreed) >= 8, "q8 left float32 within 8 tokens: a kernel error, not rounding"
    for rec in agreed:
        assert abs(rec.a.top[0].logit - rec.b.top[0].logit) <= 0.05 * abs(rec.a.top[0].logit) + 0.5
    if report.first_divergence is not None:
        assert report.first_divergence.a_margin < 1.5, "a split where float32 was not close to a tie"
