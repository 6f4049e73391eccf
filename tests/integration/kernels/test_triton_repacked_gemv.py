"""The repacked-layout GEMV (kernels/triton/repacked_gemv.py) against the torch dequant reference.

Reference: `x.float() @ w.dequantize(float32).T` (plain torch dequantization of the
file's blocks, bit-exact with gguf-py). Weights are random valid blocks (the same
generator as test_triton_gemv.py). The repacking itself must be lossless: unpacking
gives the file's bytes back exactly. CPU variants run Triton's interpreter at small
shapes; `cuda` variants the compiled kernels at Qwen2.5-7B shapes.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import assert_close_to_reference, random_weight, reference  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels import fallbacks  # noqa: E402
from minivllm.kernels.triton.repacked_gemv import REPACKED_TYPES, repack, repacked_gemv, unpack_raw  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
K_QUANTS = {T.Q4_K, T.Q6_K}
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")


def _k(t: T, legacy: int, kq: int) -> int:
    return kq if t in K_QUANTS else legacy


def test_repacked_types_are_the_promised_ones():
    assert REPACKED_TYPES == frozenset(TYPES)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_repack_is_lossless(ggml_type):
    # N = 13: not a multiple of the 4-row interleave (padding rows are dropped again).
    k = _k(ggml_type, 96, 512)
    w = random_weight(ggml_type, 13, k, seed=21)
    rw = repack(w)
    assert torch.equal(unpack_raw(rw), w.raw)
    assert torch.equal(rw.dequantize(torch.float32), w.dequantize(torch.float32))
    # Memory about the file size: at most 3% more (Q4_K's unpacked 6-bit scales), plus padding rows.
    assert rw.nbytes <= 1.03 * w.nbytes * 16 / 13


@cpu_only
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_reference_interpreted(ggml_type):
    k = _k(ggml_type, 96, 512)
    w = random_weight(ggml_type, 13, k, seed=22)
    rw = repack(w)
    gen = torch.Generator().manual_seed(23)
    for m in (1, 3):
        x = torch.randn(m, k, generator=gen)
        assert_close_to_reference(repacked_gemv(x, rw), reference(x, w), k)
    xh = torch.randn(2, k, generator=gen).half()
    assert_close_to_reference(repacked_gemv(xh, rw), reference(xh, w), k)


@cpu_only
def test_bias_and_output_dtype_interpreted():
    k = 256
    w = random_weight(T.Q4_K, 6, k, seed=24)
    rw = repack(w)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(25))
    bias = torch.randn(6, generator=torch.Generator().manual_seed(26))
    ref = reference(x, w) + bias
    y = repacked_gemv(x, rw, bias=bias)
    assert_close_to_reference(y, ref, k)
    y16 = repacked_gemv(x.half(), rw, bias=bias, out_dtype=torch.float16)
    assert y16.dtype == torch.float16
    assert torch.allclose(y16.float(), reference(x.half(), w) + bias, rtol=2e-3, atol=2e-3)


def _check_row_invariance(rw, w, k: int, device: str) -> None:
    gen = torch.Generator().manual_seed(27)
    batch = torch.randn(8, k, generator=gen).to(device)
    other = torch.randn(8, k, generator=gen).to(device) * 100
    full = repacked_gemv(batch, rw, invariant=True)
    for r in (0, 3, 7):
        alone = repacked_gemv(batch[r:r + 1].contiguous(), rw, invariant=True)
        assert torch.equal(full[r], alone[0]), f"row {r}: batch of 8 differs from the row alone"
        mixed = other.clone()
        mixed[r] = batch[r]
        assert torch.equal(repacked_gemv(mixed, rw, invariant=True)[r], alone[0]), f"row {r}: depends on other rows"
    assert_close_to_reference(full, reference(batch, w), k)


@cpu_only
@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_invariant_rows_bitwise_independent_of_batch_interpreted(ggml_type):
    k = _k(ggml_type, 64, 256)
    w = random_weight(ggml_type, 5, k, seed=28)
    _check_row_invariance(repack(w), w, k, "cpu")


# --- compiled kernels (CUDA) ---------------------------------------------------------

SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]


@pytest.fixture
def float_kernels(monkeypatch):
    """These tests pin the float kernels; the T4 profile's int8 path for half activations
    has its own tests (test_triton_q8_gemv.py)."""
    monkeypatch.delenv("MINIVLLM_GPU_PROFILE", raising=False)
    monkeypatch.delenv("MINIVLLM_Q8_GEMV", raising=False)


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_reference_cuda(ggml_type, float_kernels):
    gen = torch.Generator().manual_seed(29)
    for n, k in SHAPES_7B:
        w = random_weight(ggml_type, n, k, device="cuda", seed=30)
        rw = repack(w)
        assert torch.equal(unpack_raw(rw), w.raw)
        # The autotuned configurations on one shape (each new shape costs compiles).
        tune = (n, k) == (18944, 3584)
        for m in (1, 2, 8):
            x = torch.randn(m, k, generator=gen).cuda()
            ref = reference(x, w)
            assert_close_to_reference(repacked_gemv(x, rw, autotune=tune), ref, k)
            assert_close_to_reference(repacked_gemv(x, rw, invariant=True), ref, k)
            assert_close_to_reference(repacked_gemv(x.half(), rw, autotune=tune), reference(x.half(), w), k)
            y16 = repacked_gemv(x.half(), rw, out_dtype=torch.float16, autotune=tune)
            assert y16.dtype == torch.float16
            torch.testing.assert_close(
                y16.float(), reference(x.half(), w), rtol=2e-3, atol=2e-3 * ref.abs().max().item()
            )


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_invariant_rows_bitwise_independent_of_batch_cuda(ggml_type):
    n, k = 4096, 4096
    w = random_weight(ggml_type, n, k, device="cuda", seed=31)
    _check_row_invariance(repack(w), w, k, "cuda")


# --- T4 (sm_75) compilation, checked without a GPU -------------------------------------

_COMPILE_FOR_SM75 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton.repacked_gemv import _repacked_gemv_kernel, _repacked_gemv_rows_kernel, _FIXED
ptr = {"q": "*i32", "f16": "*fp16", "i32": "*i32", "u8": "*u8", "i8": "*i8", "i16": "*i16"}
planes = {0: ("f16", "i32", "i32", "i32"), 1: ("f16", "f16", "i32", "i32"), 2: ("f16", "i32", "i32", "i32"),
          3: ("f16", "i32", "i32", "i32"), 4: ("f16", "f16", "u8", "u8"), 5: ("f16", "i16", "i8", "i8")}
out = {}
for kind, (a, b, c, e) in planes.items():
    for has_bias in (False, True):
        sig = {"x_ptr": "*fp16", "q_ptr": "*i32", "a_ptr": ptr[a], "b_ptr": ptr[b], "c_ptr": ptr[c], "e_ptr": ptr[e],
               "bias_ptr": "*fp32", "out_ptr": "*fp16", "M": "i32", "N": "i32", "stride_xm": "i32",
               "stride_xk": "i32", "stride_om": "i32"}
        sig.update({k: "constexpr" for k in ("N_GROUPS", "KIND", "T", "RR", "BLOCK_G", "HAS_BIAS")})
        const = {"N_GROUPS": 16, "KIND": kind, "T": 8 if kind == 3 else 4, "RR": 4, "BLOCK_G": _FIXED["BLOCK_G"],
                 "HAS_BIAS": has_bias}
        k = triton.compile(ASTSource(_repacked_gemv_kernel, sig, const), target=GPUTarget("cuda", 75, 32),
                           options={"num_warps": _FIXED["num_warps"]})
        out[f"{kind}/{has_bias}"] = k.asm["ptx"]
    sig_rows = dict(sig)
    const_rows = dict(const, BLOCK_G=16, BLOCK_M=8)
    sig_rows["BLOCK_M"] = "constexpr"
    k = triton.compile(ASTSource(_repacked_gemv_rows_kernel, sig_rows, const_rows), target=GPUTarget("cuda", 75, 32),
                       options={"num_warps": 4})
    out[f"{kind}/rows"] = k.asm["ptx"]
print(json.dumps({key: {"target": ".target sm_75" in p, "bf16": "bf16" in p, "mma": "mma." in p}
                  for key, p in out.items()}))
"""


def test_kernels_compile_for_t4_sm75_without_bf16_or_mma():
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM75], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 18
    for key, r in result.items():
        assert r == {"target": True, "bf16": False, "mma": False}, key


@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q5_0, T.Q8_0], ids=lambda t: t.name)
def test_unpack_in_row_pieces_is_the_same(ggml_type, monkeypatch):
    from minivllm.kernels import repacked_layout

    k = _k(ggml_type, 64, 256)
    w = random_weight(ggml_type, 37, k, seed=35)  # 37 rows: pieces of 8 rows, the last one short and padded
    monkeypatch.setattr(repacked_layout, "_UNPACK_ROWS", 8)
    assert torch.equal(unpack_raw(repack(w)), w.raw)


def test_repacked_quantized_weight_stands_in_for_the_blocks():
    from minivllm.kernels.triton.repacked_gemv import RepackedQuantizedWeight

    w = random_weight(T.Q6_K, 8, 256, seed=32)
    rq = RepackedQuantizedWeight(repack(w))
    assert rq.shape == w.shape and rq.ggml_type == w.ggml_type and rq.type_name == "Q6_K" and not rq.is_float
    assert torch.equal(rq.raw, w.raw)
    assert torch.equal(rq.dequantize(torch.float16), w.dequantize(torch.float16))
    assert rq.nbytes == w.nbytes and rq.device == w.device and "Q6_K" in repr(rq)


@pytest.mark.cuda
def test_quant_linear_uses_the_repacked_kernel_and_falls_back_with_a_warning(monkeypatch, float_kernels):
    """On CUDA a QuantLinear keeps only the repacked planes, adds its bias inside the
    kernel, and, where the kernel cannot compile, warns once naming it and takes
    dequantize + cuBLAS."""
    from minivllm.kernels import linear as lin
    from minivllm.kernels.kernel_options import KernelOptions
    from minivllm.kernels.triton import repacked_gemv as rg

    w = random_weight(T.Q4_K, 512, 1024, device="cuda", seed=33)
    bias = torch.randn(512, device="cuda")
    layer = lin.QuantLinear(w, bias, options=KernelOptions(gemv_max_rows=8, dequant_cache=False),
                            compute_dtype=torch.float16, name="attn_q")
    assert layer.gemv_kind == "triton-repacked-Q4_K" and isinstance(layer.weight, rg.RepackedQuantizedWeight)
    x = torch.randn(2, 1024, device="cuda").half()
    ref = reference(x, w) + bias
    y = layer(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())

    w6 = random_weight(T.Q6_K, 256, 512, device="cuda", seed=34)
    broken = lin.QuantLinear(w6, None, options=KernelOptions(gemv_max_rows=8, dequant_cache=False),
                             compute_dtype=torch.float16, name="ffn_down")

    def fail(*a, **k):
        raise RuntimeError("PTX compile failed (simulated)")

    monkeypatch.setattr(rg, "repacked_gemv", fail)
    monkeypatch.setattr(fallbacks, "_failed", {})
    monkeypatch.setattr(lin, "_CUDA_KERNEL_OK", set())
    x6 = torch.randn(1, 512, device="cuda").half()
    with pytest.warns(RuntimeWarning, match=r"repacked_gemv\[Q6_K\].*dequantize \+ cuBLAS"):
        y6 = broken(x6)
    torch.testing.assert_close(y6.float(), reference(x6, w6), rtol=2e-3, atol=2e-3 * y6.abs().max().item())
    assert broken.gemv_kind == "dequant-cublas-Q6_K"
    assert fallbacks.fallbacks() == ["repacked_gemv[Q6_K, 512, torch.float16]: RuntimeError"]  # what benches report


@cpu_only
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_multi_row_kernel_matches_reference_interpreted(ggml_type):
    """M > 1 without invariance: the kernel that decodes each weight field once for up to
    8 rows (M = 2, 3, 8, 9: one block, a padded block, full blocks and a remainder)."""
    k = _k(ggml_type, 64, 256)
    w = random_weight(ggml_type, 9, k, seed=36)
    rw = repack(w)
    gen = torch.Generator().manual_seed(37)
    for m in (2, 3, 9):
        x = torch.randn(m, k, generator=gen)
        assert_close_to_reference(repacked_gemv(x, rw), reference(x, w), k)
    bias = torch.randn(9, generator=gen)
    x = torch.randn(8, k, generator=gen).half()
    assert_close_to_reference(repacked_gemv(x, rw, bias=bias), reference(x, w) + bias, k)
