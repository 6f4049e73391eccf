"""The few-rows GEMV (kernels/triton/multirow_gemv.py) against the torch dequant reference:
each of M rows decoded from one weight tile must equal `x.float() @ w.dequantize().T` up to
float32 summation order, whatever M (across row blocks of 8), the K split, the bias and the
output dtype; deferred split-K slices must sum to it. CPU runs Triton's interpreter at
small shapes; the sm_75 and sm_90 compiles are checked without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import assert_close_to_reference, random_weight, reference  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.repacked_layout import repack  # noqa: E402
from minivllm.kernels.triton.multirow_gemv import multirow_gemv  # noqa: E402
from minivllm.kernels.triton.split_sum import SplitPartials  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")


@cpu_only
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m, split", [(2, 1), (3, 3), (11, 2)], ids=["m2", "m3-split3", "m11-two-row-blocks-split2"])
def test_every_row_is_the_product_interpreted(ggml_type, m, split):
    n, k = 21, 768  # a partial row group and a partial tile; 24 groups: a trip of 16 and a partial one
    w = random_weight(ggml_type, n, k, seed=61)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(62))
    y = multirow_gemv(x, repack(w), split=split)
    assert_close_to_reference(y, reference(x, w), k)


@cpu_only
def test_bias_dtype_and_deferred_slices_interpreted():
    n, k, m = 40, 1024, 5  # 32 groups: two slices of one trip each
    w = random_weight(T.Q4_K, n, k, seed=63)
    rw = repack(w)
    gen = torch.Generator().manual_seed(64)
    x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
    ref = reference(x, w) + bias
    assert_close_to_reference(multirow_gemv(x, rw, bias=bias), ref, k)
    half = multirow_gemv(x.half(), rw, bias=bias, out_dtype=torch.float16)
    assert half.dtype == torch.float16
    assert torch.allclose(half.float(), reference(x.half(), w) + bias, rtol=2e-3, atol=2e-3 * ref.abs().max())
    parts = multirow_gemv(x, rw, split=2, bias=bias, defer_split_sum=True)
    assert isinstance(parts, SplitPartials) and parts.split == 2 and parts.shape == (m, n)
    assert_close_to_reference(parts.ws.sum(0) + bias, ref, k)
    assert multirow_gemv(x[:0], rw).shape == (0, n)


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton.multirow_gemv import _multirow_gemv_kernel, BLOCK_NB, BLOCK_G
out = {}
for kind, t, planes in ((4, 4, ("*fp16", "*fp16", "*u8", "*u8")), (5, 4, ("*fp16", "*i16", "*i8", "*i8"))):
    sig = {"x_ptr": "*fp16", "q_ptr": "*i32", "a_ptr": planes[0], "b_ptr": planes[1], "c_ptr": planes[2],
           "e_ptr": planes[3], "bias_ptr": "*fp16", "out_ptr": "*fp16", "M": "i32", "N": "i32", "stride_xm": "i32",
           "stride_om": "i32", "stride_os": "i32", "G_PER_SPLIT": "i32", "N_RB": "i32", "ONES": "i32",
           "N_GROUPS": "constexpr", "KIND": "constexpr", "T": "constexpr", "RR": "constexpr", "BLOCK_NB": "constexpr",
           "BLOCK_G": "constexpr", "BLOCK_M": "constexpr", "IS_SPLIT": "constexpr", "HAS_BIAS": "constexpr",
           "PDL": "constexpr"}
    consts = {"N_GROUPS": 112, "KIND": kind, "T": t, "RR": 4, "BLOCK_NB": BLOCK_NB, "BLOCK_G": BLOCK_G, "BLOCK_M": 8,
              "IS_SPLIT": False, "HAS_BIAS": False, "PDL": False}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}  # the pointers, as a launch specializes them
    k = triton.compile(ASTSource(_multirow_gemv_kernel, sig, consts, attrs),
                       target=GPUTarget("cuda", int(sys.argv[1]), 32))
    ptx = k.asm["ptx"]
    import os, re, subprocess, tempfile
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    out[kind] = {"bf16": "bf16" in ptx, "mma": "mma.sync" in ptx or "wgmma" in ptx,
                 "wide_loads": len(re.findall(r"ld\.global[^;]*\.v4\.b32", ptx)),
                 "regs": int(found.group(1)) if found else None, "stack": int(found.group(2)) if found else None}
print(json.dumps(out))
"""


@pytest.mark.parametrize("arch", ["75", "90"])
def test_multirow_kernel_compiles_for_t4_sm75_and_sm90_without_bf16_or_mma(arch):
    """Compiled without a GPU (Triton's own compiler for the target), Q4_K and Q6_K: no bf16,
    no tensor-core instructions (sm_75 runs it), 16-byte weight loads, and no register
    spills at BLOCK_M = 8 (96 registers a thread at sm_90 when written)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, arch], capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("no ptxas for this target in this Triton install")
    assert done.returncode == 0, done.stderr[-2000:]
    for kind, facts in json.loads(done.stdout.strip().splitlines()[-1]).items():
        assert not facts["bf16"] and not facts["mma"], (kind, facts)
        assert facts["stack"] in (0, None), (kind, facts)  # None: no cuobjdump in this Triton install
        assert facts["wide_loads"] > 0, (kind, facts)  # the word tile in 16-byte loads
