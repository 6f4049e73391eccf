"""The fused decoder-layer kernels (kernels/triton/fused.py) against the torch references.

add_rms_norm vs `h + delta` then `kernels.rmsnorm.rms_norm`; rope_qk vs
`RotaryEmbedding.apply` in both GGUF layouts; swiglu vs silu(g) * u in float32. Rows
must be bitwise the same alone and in a batch. CPU runs Triton's interpreter.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY_QWEN_PROMPTS  # noqa: E402
from triton_devices import DEVICES  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.rmsnorm import rms_norm  # noqa: E402
from minivllm.kernels.rope import RotaryEmbedding  # noqa: E402
from minivllm.kernels.triton.fused import add_rms_norm, rope_qk, swiglu  # noqa: E402


@pytest.fixture
def device(request):
    return torch.device(request.param)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("d", [896, 64])
def test_add_rms_norm_matches_reference(device, d):
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(5, d, generator=gen).to(device)
    delta = torch.randn(5, d, generator=gen).half().to(device)
    w = (1 + 0.1 * torch.randn(d, generator=gen)).to(device)
    h2, x = add_rms_norm(h, delta, w, 1e-6, torch.float16)
    ref_h = h + delta.float()
    assert torch.equal(h2, ref_h)
    torch.testing.assert_close(x.float(), rms_norm(ref_h, w, 1e-6).half().float(), rtol=1e-3, atol=1e-3)
    h3, x32 = add_rms_norm(h, None, w, 1e-6, torch.float32)
    assert h3 is h
    torch.testing.assert_close(x32, rms_norm(h, w, 1e-6), rtol=1e-5, atol=1e-5)
    for r in (0, 4):  # a row alone: the same bits
        assert torch.equal(add_rms_norm(h[r:r + 1].contiguous(), delta[r:r + 1].contiguous(), w, 1e-6,
                                        torch.float16)[1][0], x[r])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("style", ["halves", "adjacent"])
def test_rope_qk_matches_reference(device, style):
    gen = torch.Generator().manual_seed(2)
    t, h, kvh, d = 4, 6, 2, 64
    rope = RotaryEmbedding(d, 10000.0, style, device=device)
    pos = torch.tensor([0, 5, 17, 300], device=device)
    cos, sin = rope.cos_sin(pos)
    q = torch.randn(t, h, d, generator=gen).half().to(device)
    k = torch.randn(t, kvh, d, generator=gen).half().to(device)
    qo, ko = rope_qk(q, k, cos, sin, style)
    assert qo.dtype == torch.float32 and ko.dtype == torch.float16
    torch.testing.assert_close(qo, rope.apply(q, cos, sin, out_dtype=torch.float32), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko.float(), rope.apply(k, cos, sin).float(), rtol=1e-3, atol=1e-3)
    q1, k1 = rope_qk(q[2:3].contiguous(), k[2:3].contiguous(), cos[2:3], sin[2:3], style)
    assert torch.equal(q1[0], qo[2]) and torch.equal(k1[0], ko[2])


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_swiglu_matches_reference(device):
    gen = torch.Generator().manual_seed(3)
    g = (3 * torch.randn(3, 1500, generator=gen)).half().to(device)
    u = torch.randn(3, 1500, generator=gen).half().to(device)
    y = swiglu(g, u, torch.float16)
    ref = (torch.nn.functional.silu(g.float()) * u.float()).half()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-3, atol=2e-3)
    assert torch.equal(swiglu(g[1:2].contiguous(), u[1:2].contiguous(), torch.float16)[0], y[1])


_COMPILE_FOR_SM75 = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton import fused as f
attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
out = {}
for split in (1, 3):  # a plain delta, and a split GEMV's partials summed in the kernel (+ bias, f16 rounding)
    sig = {"h_ptr": "*fp32", "y_ptr": "*fp16" if split == 1 else "*fp32", "w_ptr": "*fp32", "h_out_ptr": "*fp32",
           "x_out_ptr": "*fp16", "bias_ptr": "*fp32", "stride_h": "i32", "stride_y": "i32", "stride_ys": "i32",
           "stride_ho": "i32", "stride_xo": "i32", "n_cols": "i32", "eps": "fp32"}
    const = {"HAS_Y": True, "SPLIT": split, "HAS_BIAS": split > 1, "ROUND": 16 if split > 1 else 0, "BLOCK": 4096,
             "PDL": False}
    sig.update({n: "constexpr" for n in const})
    k = triton.compile(ASTSource(f._add_rms_norm_kernel, sig, const, attrs=attrs),
                       target=GPUTarget("cuda", 75, 32), options={"num_warps": 4})
    out[f"add_rms_norm/split={split}"] = k.asm["ptx"]
sig = {"q_ptr": "*fp16", "k_ptr": "*fp16", "qo_ptr": "*fp32", "ko_ptr": "*fp16", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
sig.update({n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_qot", "stride_qoh",
                               "stride_kot", "stride_koh", "stride_c")})
sig.update({"v_ptr": "*fp16", "kc_ptr": "*fp16", "vc_ptr": "*fp16", "slots_ptr": "*i64"})
sig.update({n: "i32" for n in ("stride_vt", "stride_vh", "stride_kcs", "stride_kch", "stride_vcs", "stride_vch")})
sig.update({"stride_ws": "i32", "qb_ptr": "*fp16", "kb_ptr": "*fp16", "stride_wsv": "i32", "vb_ptr": "*fp16"})
for store in (False, True):  # RoPE alone, and RoPE storing K and V into their page slots
    const = {"H": 28, "KVH": 4, "HALF": 64, "ADJACENT": False, "BLOCK_H": 32, "BLOCK_KVH": 4, "STORE": store,
             "SPLIT": 1, "HAS_BIAS": False, "ROUND": 0, "SPLIT_V": 1, "HAS_BIAS_V": False, "ROUND_V": 0, "PDL": False}
    sig.update({n: "constexpr" for n in const})
    k = triton.compile(ASTSource(f._rope_qk_kernel, sig, const, attrs=attrs), target=GPUTarget("cuda", 75, 32),
                       options={"num_warps": 4})
    out[f"rope_qk/store={store}"] = k.asm["ptx"]
# RoPE reading a fused Q|K|V GEMV's split-K partials (rope_qk_partials): slices summed, bias, f16 rounding
sig.update({"q_ptr": "*fp32", "k_ptr": "*fp32", "v_ptr": "*fp32", "qb_ptr": "*fp32", "kb_ptr": "*fp32",
            "vb_ptr": "*fp32"})
const = {"H": 28, "KVH": 4, "HALF": 64, "ADJACENT": False, "BLOCK_H": 32, "BLOCK_KVH": 4, "STORE": True,
         "SPLIT": 4, "HAS_BIAS": True, "ROUND": 16, "SPLIT_V": 4, "HAS_BIAS_V": True, "ROUND_V": 16, "PDL": False}
sig.update({n: "constexpr" for n in const})
k = triton.compile(ASTSource(f._rope_qk_kernel, sig, const, attrs=attrs), target=GPUTarget("cuda", 75, 32),
                   options={"num_warps": 4})
out["rope_qk/partials"] = k.asm["ptx"]
sig = {"g_ptr": "*fp16", "u_ptr": "*fp16", "out_ptr": "*fp16", "n_cols": "i32", "stride_g": "i32", "stride_u": "i32",
       "stride_o": "i32", "BLOCK": "constexpr", "PDL": "constexpr"}
k = triton.compile(ASTSource(f._swiglu_kernel, sig, {"BLOCK": 1024, "PDL": False}, attrs=attrs),
                   target=GPUTarget("cuda", 75, 32), options={"num_warps": 4})
out["swiglu"] = k.asm["ptx"]
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
    assert len(result) == 6
    for key, r in result.items():
        assert r == {"target": True, "bf16": False, "mma": False}, key


@pytest.mark.cuda
def test_fused_decoder_forward_matches_the_torch_steps(tiny_qwen_gguf, monkeypatch):
    """A small synthetic Qwen2 file (k-quant and Q5_0/Q8_0 fallback tensors) on CUDA: the
    fused forward's logits match the torch steps' (MINIVLLM_FUSED=0), and greedy decoding
    gives the same tokens; batch-invariant mode stays bit-identical solo vs batched."""

    from minivllm.engine.llm import LLM
    from minivllm.sampling.sampling_params import SamplingParams

    path, prompts = tiny_qwen_gguf, TINY_QWEN_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    fused = LLM(str(path), progress=False, max_model_len=128, device="cuda", dtype="f16")
    ids = fused.tokenizer.encode(prompts[2])
    from synthetic_gguf import minivllm_logits

    a = minivllm_logits(fused.model, ids)
    toks = [o.token_ids for o in fused.generate(prompts, params)]
    monkeypatch.setenv("MINIVLLM_FUSED", "0")
    b = minivllm_logits(fused.model, ids)
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
    plain = [o.token_ids for o in fused.generate(prompts, params)]
    assert sum(x == y for t1, t2 in zip(toks, plain) for x, y in zip(t1, t2)) >= 0.8 * sum(map(len, toks))
    monkeypatch.setenv("MINIVLLM_FUSED", "1")
    inv = fused.fork(batch_invariant=True)
    solo = [inv.generate([p], params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in inv.generate(prompts, params)] == solo
