"""The opt-in int8-activation GEMV (kernels/triton/q8_gemv.py, MINIVLLM_Q8_GEMV=1).

quantize_q8: every value within half a step of the input, |q| <= 127, the group's
largest magnitude exactly 127 steps. q8_gemv against the torch dequantization of the
weight times the *quantized* activations (float64): integer sums are exact, so only
float32 rounding of per-group terms may differ. CPU runs the interpreter with dp4a
emulated; CUDA the PTX dp4a.
"""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import assert_close_to_reference, random_weight  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.gemv_configs import GemvConfig  # noqa: E402
from minivllm.kernels.triton.q8_gemv import Q8_TYPES, q8_gemv, quantize_q8, unpack_q8  # noqa: E402
from minivllm.kernels.triton.repacked_gemv import repack, repacked_gemv  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")


def _dequant_x(x: torch.Tensor):
    xw, dx = quantize_q8(x)
    q = unpack_q8(xw).double()
    return (q.view(x.shape[0], -1, 32) * dx.double()[:, :, None]).view(x.shape), (xw, dx), q


def _check_quantization(x: torch.Tensor) -> None:
    xd, (xw, dx), q = _dequant_x(x)
    assert q.abs().max() <= 127
    groups = x.double().view(x.shape[0], -1, 32)
    step = dx.double()[:, :, None]
    assert ((xd.view_as(groups) - groups).abs() <= 0.5 * step * (1 + 1e-5) + 1e-30).all()
    assert (q.view_as(groups).abs().amax(dim=2)[dx > 0] == 127).all()


def _check_gemv(ggml_type: T, n: int, k: int, device: str, seed: int, config=None) -> None:
    w = random_weight(ggml_type, n, k, device=device, seed=seed)
    rw = repack(w)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    x[1, :32] = 0.0  # an all-zero group
    xd, xq, _ = _dequant_x(x)
    ref = (xd @ w.dequantize(torch.float32).double().T).float()
    y = q8_gemv(x, rw, config, xq=xq)
    assert_close_to_reference(y, ref, k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)).to(device)
    assert_close_to_reference(q8_gemv(x, rw, config, bias=bias), ref + bias, k)
    # A row alone: the same bits.
    assert torch.equal(q8_gemv(x[2:3].contiguous(), rw, config)[0], y[2])


def test_types():
    assert Q8_TYPES == frozenset(TYPES)


@cpu_only
def test_quantize_q8_interpreted():
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 32:64] = 0.0
    _check_quantization(x)
    _check_quantization(x.half())


@cpu_only
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_quantized_reference_interpreted(ggml_type):
    k = 512 if ggml_type in (T.Q4_K, T.Q6_K) else 96
    for config in (None, GemvConfig(block_nb=2, block_g=2, split=3), GemvConfig(block_nb=4, block_g=8, split=1)):
        _check_gemv(ggml_type, 9, k, "cpu", seed=3, config=config)


@cpu_only
def test_opt_in_switch_routes_repacked_gemv(monkeypatch):
    w = random_weight(T.Q4_0, 5, 64, seed=5)
    rw = repack(w)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(6)).half()  # float32 never takes int8
    monkeypatch.setenv("MINIVLLM_Q8_GEMV", "1")
    assert torch.equal(repacked_gemv(x, rw), q8_gemv(x, rw))
    monkeypatch.setenv("MINIVLLM_Q8_GEMV", "0")
    assert not torch.equal(repacked_gemv(x, rw), q8_gemv(x, rw))


@cpu_only
def test_projections_of_one_input_share_its_quantization():
    from minivllm.kernels.triton import q8_gemv as q8

    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(8))
    with q8.sharing_quantization(x):
        first = q8.quantize_shared(x)
        assert q8.quantize_shared(x) is first  # the same tensor in the scope: reused
        assert q8.quantize_shared(x.clone()) is not first  # another tensor
    assert q8.quantize_shared(x) is not first  # outside the scope: quantized again
    x.mul_(2)
    with q8.sharing_quantization(x):  # a new scope over the same buffer sees its new contents
        assert torch.equal(q8.quantize_shared(x)[1], first[1] * 2)


@cpu_only
def test_inference_tensors_quantize(monkeypatch):
    """The engine runs under torch.inference_mode(), whose tensors keep no version counter
    (an identity cache keyed on x._version broke every int8 GEMV there)."""
    monkeypatch.setenv("MINIVLLM_Q8_GEMV", "1")
    w = random_weight(T.Q4_K, 8, 256, seed=9)
    rw = repack(w)
    with torch.inference_mode():
        x = torch.randn(1, 256, generator=torch.Generator().manual_seed(10)).half()
        y = repacked_gemv(x, rw)
        with __import__("minivllm.kernels.triton.q8_gemv", fromlist=["x"]).sharing_quantization(x):
            assert torch.equal(repacked_gemv(x, rw), y)
    assert torch.equal(y, q8_gemv(x, rw))


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_matches_quantized_reference_cuda(ggml_type):
    _check_quantization(torch.randn(2, 3584, device="cuda"))
    for n, k in [(3584, 3584), (512, 3584), (3584, 18944)]:
        _check_gemv(ggml_type, n, k, "cuda", seed=7)


_COMPILE_FOR_SM75 = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton import q8_gemv as q
attrs = {(i,): [["tt.divisibility", 16]] for i in range(9)}
planes = {0: ("*fp16", "*i32", "*i32", "*i32"), 1: ("*fp16", "*fp16", "*i32", "*i32"),
          2: ("*fp16", "*i32", "*i32", "*i32"), 3: ("*fp16", "*i32", "*i32", "*i32"),
          4: ("*fp16", "*fp16", "*u8", "*u8"), 5: ("*fp16", "*i16", "*i8", "*i8")}
out = {}
for kind, (a, b, c, e) in planes.items():
    sig = {"xw_ptr": "*i32", "dx_ptr": "*fp32", "q_ptr": "*i32", "a_ptr": a, "b_ptr": b, "c_ptr": c, "e_ptr": e,
           "bias_ptr": "*fp32", "out_ptr": "*fp16", "M": "i32", "N": "i32", "stride_om": "i32", "stride_os": "i32",
           "G_PER_SPLIT": "i32", "N_RB": "i32"}
    const = {"N_GROUPS": 112, "KIND": kind, "T": 8 if kind == 3 else 4, "RR": 4, "BLOCK_NB": 4,
             "BLOCK_G": 32, "IS_SPLIT": False, "HAS_BIAS": True, "EMULATE": False, "PDL": False}
    sig.update({k: "constexpr" for k in const})
    k = triton.compile(ASTSource(q._q8_gemv_kernel, sig, const, attrs=attrs), target=GPUTarget("cuda", 75, 32),
                       options={"num_warps": 4})
    out[f"gemv/{kind}"] = k.asm["ptx"]
sig = {"x_ptr": "*fp16", "xw_ptr": "*i32", "dx_ptr": "*fp32", "stride_xm": "i32", "N_GROUPS": "constexpr",
       "BLOCK_G": "constexpr", "PDL": "constexpr"}
k = triton.compile(ASTSource(q._quantize_q8_kernel, sig, {"N_GROUPS": 112, "BLOCK_G": 32, "PDL": False},
                             attrs={(i,): [["tt.divisibility", 16]] for i in range(3)}),
                   target=GPUTarget("cuda", 75, 32), options={"num_warps": 4})
out["quantize"] = k.asm["ptx"]
print(json.dumps({key: {"target": ".target sm_75" in p, "bf16": "bf16" in p, "mma": "mma." in p,
                        "dp4a": "dp4a" in p} for key, p in out.items()}))
"""


def test_kernels_compile_for_t4_sm75_with_dp4a():
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM75], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 7
    for key, r in result.items():
        assert r == {"target": True, "bf16": False, "mma": False, "dp4a": key != "quantize"}, key
