"""The tensor-core Q4_K GEMV (kernels/triton/mma_gemv.py) against float64 references.

Reference: float64 x @ dequantize(W).T, x f16 (what the kernel takes). The products
(q * sc) * x are exact and the sums float32, so the error is float32 summation's:
bounded like the float GEMV's (test_triton_gemv.assert_close_to_reference). A decode
that put a field in the wrong place, dropped the mins or mixed up two rows' scales
fails that bound by orders of magnitude. Also: a row's bits do not depend on the other
rows or on M (batch-invariant mode), split-K sums in slice order, the switch
(MINIVLLM_GEMV_KERNEL=mma) and where it applies, and the compiled sm_90 / sm_80 code
(the packed f16x2 decode and tensor-core instructions) without a device.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import random_weight  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.gemv_configs import GEMV_KERNEL_ENV  # noqa: E402
from minivllm.kernels.repacked_layout import repack  # noqa: E402
from minivllm.kernels.triton import mma_gemv as mg  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")


def _reference(x: torch.Tensor, w) -> torch.Tensor:
    return x.double() @ w.dequantize(torch.float32).double().T


def _assert_float32_grade(y: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    assert y.dtype == torch.float32 and y.shape == ref.shape and torch.isfinite(y).all()
    scale = ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert err <= 2e-6 * (k ** 0.5) * scale, f"max error {err:.3g} vs reference magnitude {scale:.3g}"


@cpu_only
@pytest.mark.parametrize("n, block_nb, split", [(21, 4, 1), (36, 4, 2), (64, 8, 3)])
def test_q4k_matches_float64_interpreted(n, block_nb, split):
    """N not a multiple of a program's rows (21, 36; 21 not even of 4), K = 768: three superblocks, split in 1,
    2 (uneven) and 3 slices; two activation rows, one of them large (1e3) so a lost bit of
    the mins or of the scales shows."""
    k = 768
    w = random_weight(T.Q4_K, n, k, seed=n)
    rw = repack(w)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(n + 1)).half()
    x[1] *= 1000
    y = mg.mma_gemv(x, rw, block_nb=block_nb, split=split)
    _assert_float32_grade(y, _reference(x, w), k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3))
    yb = mg.mma_gemv(x, rw, block_nb=block_nb, split=split, bias=bias)
    _assert_float32_grade(yb, _reference(x, w) + bias.double(), k)
    y16 = mg.mma_gemv(x[:1], rw, block_nb=block_nb, split=split, out_dtype=torch.float16)  # row 1 is past f16
    assert y16.dtype == torch.float16 and torch.equal(y16, y[:1].half())  # one rounding, of the same sums


@cpu_only
def test_q4k_rows_independent_of_the_batch_interpreted():
    """A row alone, among 4 others, and among 19 (two MMA_N blocks of activation rows)
    gives the same bits; other rows' values do not leak into it."""
    k, n = 512, 24
    w = random_weight(T.Q4_K, n, k, seed=7)
    rw = repack(w)
    gen = torch.Generator().manual_seed(8)
    batch = torch.randn(19, k, generator=gen).half()
    full = mg.mma_gemv(batch, rw)
    for r in (0, 4, 18):
        alone = mg.mma_gemv(batch[r:r + 1].contiguous(), rw)
        assert torch.equal(full[r], alone[0]), r
    five = batch[:5].clone()
    five[1:] *= 100
    five[0] = batch[0]
    assert torch.equal(mg.mma_gemv(five, rw)[0], full[0])
    _assert_float32_grade(full, _reference(batch, w), k)


def test_where_it_applies(monkeypatch):
    """Only when asked for, only Q4_K weights with f16 activations (float32 stays float32)."""
    w = repack(random_weight(T.Q4_K, 8, 256, seed=1))
    q6 = repack(random_weight(T.Q6_K, 8, 256, seed=1))
    x = torch.zeros(1, 256, dtype=torch.float16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(GEMV_KERNEL_ENV, raising=False)
    assert not mg.mma_gemv_applies(x, w)
    monkeypatch.setenv(GEMV_KERNEL_ENV, "mma")
    assert mg.mma_gemv_applies(x, w)
    assert not mg.mma_gemv_applies(x.float(), w) and not mg.mma_gemv_applies(x, q6)
    with pytest.raises(ValueError, match="Q4_K weights and f16 activations"):
        mg.mma_gemv(x.float(), w)


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton.mma_gemv import _mma_gemv_q4k_kernel
arch = int(sys.argv[1])
sig = {"x_ptr": "*fp16", "q_ptr": "*i32", "d_ptr": "*fp16", "dmin_ptr": "*fp16", "sc_ptr": "*u8", "mn_ptr": "*u8",
       "bias_ptr": "*fp32", "out_ptr": "*fp16", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_om": "i32",
       "stride_os": "i32", "SB_PER_SPLIT": "i32"}
out = {}
for split in (False, True):
    const = {"N_GROUPS": 112, "BLOCK_NB": 4, "IS_SPLIT": split, "HAS_BIAS": not split, "ASM": True,
             "PDL": arch >= 90}
    sig.update({k: "constexpr" for k in const})
    k = triton.compile(ASTSource(_mma_gemv_q4k_kernel, dict(sig, out_ptr="*fp32" if split else "*fp16"), const),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    p = k.asm["ptx"]
    out[str(split)] = {"f16x2": "fma.rn.f16x2" in p, "tensor_cores": "mma.sync" in p or "wgmma" in p,
                       "target": f".target sm_{arch}" in p}
print(json.dumps(out))
"""


@pytest.mark.parametrize("arch", ["80", "90"])
def test_compiles_with_the_packed_decode_and_tensor_cores(arch):
    """The compiled kernel (split or not) decodes with packed f16x2 FMAs and multiplies on
    tensor cores, for an A100 and an H100, without a device."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, arch], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {s: {"f16x2": True, "tensor_cores": True, "target": True} for s in ("False", "True")}, result


@cpu_only
def test_repacked_gemv_takes_it_when_asked_interpreted(monkeypatch):
    """`repacked_gemv` (the engine's entry) runs this kernel under MINIVLLM_GEMV_KERNEL=mma
    for a Q4_K weight and one f16 row, its K split in slices handed back unsummed when
    asked (the next add+RMSNorm sums them): the same values as summing them here."""
    from minivllm.kernels.triton import repacked_gemv as rg
    from minivllm.kernels.triton.split_sum import SplitPartials
    from minivllm.kernels.triton.tiled_gemv import sum_splits

    k, n = 1024, 12
    w = random_weight(T.Q4_K, n, k, seed=5)
    rw = repack(w)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6)).half()
    calls = []
    real = mg.mma_gemv
    monkeypatch.setattr(mg, "mma_gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    monkeypatch.setenv(GEMV_KERNEL_ENV, "mma")
    y = rg.repacked_gemv(x, rw)
    assert len(calls) == 1 and calls[0]["split"] == 4  # one program (3 row groups): every superblock a slice
    _assert_float32_grade(y, _reference(x, w), k)
    parts = rg.repacked_gemv(x, rw, defer_split_sum=True)
    assert isinstance(parts, SplitPartials) and parts.ws.shape == (4, 1, n)
    summed = torch.empty(1, n)
    sum_splits(parts.ws, summed, parts.bias)  # the split_sum rule, as add+RMSNorm applies it
    assert torch.equal(summed, y)
    monkeypatch.delenv(GEMV_KERNEL_ENV)
    rg.repacked_gemv(x, rw)
    assert len(calls) == 2  # not asked: the float kernel ran, this one was not called again


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("n, k", [(3584, 3584), (4608, 3584), (18944, 3584), (3584, 18944)])
def test_q4k_at_7b_shapes_on_the_gpu(n, k):
    """The compiled kernel (packed decode, tensor cores) at the Qwen2.5-7B shapes, with the
    engine's launch for them: float32-grade against float64, a row's bits the same alone
    and in a batch of 5, and within the float kernel's distance of it."""
    from minivllm.kernels.gpu_profile import gpu_profile
    from minivllm.kernels.triton.repacked_gemv import repacked_gemv

    dev = torch.device("cuda")
    if not gpu_profile(dev).tensor_core_dot:
        pytest.skip("this profile has no tl.dot (the T4 profile): the kernel never runs here")
    w = random_weight(T.Q4_K, n, k, seed=n + k, device="cuda")
    rw = repack(w)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).half().to(dev)
    block_nb, split = mg.mma_launch(n, k, gpu_profile(dev).sm_count)
    y = mg.mma_gemv(x, rw, block_nb=block_nb, split=split)
    ref = x.double() @ w.dequantize(torch.float32).double().T
    _assert_float32_grade(y, ref, k)
    alone = mg.mma_gemv(x[2:3].contiguous(), rw, block_nb=block_nb, split=split)
    assert torch.equal(alone[0], y[2])
    _assert_float32_grade(repacked_gemv(x[:1], rw), ref[:1], k)  # the float kernel, for scale


@pytest.mark.cuda
@needs_gpu
def test_decode_with_the_mma_gemv_agrees_with_the_float_kernel(tiny_qwen_gguf, monkeypatch):
    """The engine with MINIVLLM_GEMV_KERNEL=mma (its Q4_K projections on tensor cores,
    gate+up then the swiglu kernel), f16, CUDA graphs, batch-invariant mode (every GEMV row
    through the same kernels, prompts too): the same greedy tokens as the float kernel,
    and the kernel was launched at all. Two float32-grade GEMVs differ in the last bits
    only, far below the synthetic model's logit gaps."""
    from conftest import TINY_QWEN_PROMPTS

    from minivllm.engine.llm import LLM
    from minivllm.kernels.gpu_profile import gpu_profile
    from minivllm.sampling.sampling_params import SamplingParams

    if not gpu_profile(torch.device("cuda")).tensor_core_dot:
        pytest.skip("this profile has no tl.dot (the T4 profile): the kernel never runs here")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for kernel in ("tiled", "mma"):
        monkeypatch.setenv(GEMV_KERNEL_ENV, kernel)
        llm = LLM(str(tiny_qwen_gguf), progress=False, max_model_len=256, device="cuda", dtype="f16",
                  batch_invariant=True)
        tokens[kernel] = [o.token_ids for o in llm.generate(TINY_QWEN_PROMPTS, params)]
        del llm
        torch.cuda.empty_cache()
    assert tokens["mma"] == tokens["tiled"]
    assert any(mg._mma_gemv_q4k_kernel.device_caches.values()), "the tensor-core GEMV never ran"


@cpu_only
def test_gate_up_take_it_then_the_swiglu_kernel_interpreted(monkeypatch):
    """A fused Q4_K gate+up under MINIVLLM_GEMV_KERNEL=mma (the GPU code path on CPU
    tensors): this kernel on the fused weight, then the swiglu kernel, close to the torch
    dequantization's silu(g) * u, a row's bits the same alone and in the batch
    (batch-invariant mode), and this kernel launched, not the tiled epilogue."""
    from test_fused_projection import _linears

    from minivllm.kernels.fused_projection import fuse_projections, project_swiglu
    from minivllm.kernels.kernel_options import KernelOptions, kernel_options_for_call

    monkeypatch.setenv("MINIVLLM_TRITON_CPU", "1")
    monkeypatch.delenv("MINIVLLM_FUSED_PROJECTIONS", raising=False)
    monkeypatch.setenv(GEMV_KERNEL_ENV, "mma")
    k = 512
    opts = KernelOptions(gemv_max_rows=8, dequant_cache=False, batch_invariant=True)
    gate, up = _linears([T.Q4_K] * 2, [24, 24], k, opts, seed=5)
    wg, wu = gate.repacked.to_quantized(), up.repacked.to_quantized()
    x = (torch.randn(3, k, generator=torch.Generator().manual_seed(2)) * 0.3).half()
    fuse_projections((gate, up), "ffn_gate_up")
    calls = []
    real = mg.mma_gemv
    monkeypatch.setattr(mg, "mma_gemv", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    with kernel_options_for_call(KernelOptions(gemv_max_rows=8, dequant_cache=False, batch_invariant=True)):
        y = project_swiglu(gate, up, x, torch.float16)
        alone = project_swiglu(gate, up, x[1:2], torch.float16)
    assert calls == [(48, k), (48, k)]  # the fused weight, once a call
    assert torch.equal(alone[0], y[1])
    g = x.float() @ wg.dequantize(torch.float32).T + gate.bias
    u = x.float() @ wu.dequantize(torch.float32).T + up.bias
    ref = torch.nn.functional.silu(g) * u
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
