"""The persistent decode GEMV (kernels/triton/persistent_gemv.py) against the torch dequant
reference, and against the tiled kernel it re-launches.

Reference: `x.float() @ w.dequantize(float32).T` (plain torch dequantization of the file's
blocks). Under Triton's interpreter (CPU) at small shapes: programs that walk several tiles
(one SM's worth of programs), a last tile past the matrix's rows, a bias, f16 output. Its
bits equal the tiled kernel's at split 1 with the same row groups and groups a trip, and a
row's result does not depend on the other rows. `cuda` variants run the compiled kernel at
Qwen2.5-7B shapes.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import assert_close_to_reference, random_weight, reference  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.gemv_configs import GemvConfig  # noqa: E402
from minivllm.kernels.repacked_layout import repack  # noqa: E402
from minivllm.kernels.triton.persistent_gemv import default_block_g, persistent_gemv  # noqa: E402
from minivllm.kernels.triton.tiled_gemv import tiled_gemv  # noqa: E402

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K]
cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")


@cpu_only
@pytest.mark.parametrize("ggml_type,block_nb", [(t, 2) for t in TYPES] + [(T.Q4_K, 1)],
                         ids=lambda v: v.name if isinstance(v, T) else f"nb{v}")
def test_matches_reference_and_the_tiled_kernel_interpreted(ggml_type, block_nb):
    # N = 22: 6 row groups, the last of 2 rows; with 2 row groups a tile and one SM's 2
    # programs, each program walks 1-2 tiles. K = 512: 16 groups, 4 trips of 4.
    n, k = 22, 512
    w = random_weight(ggml_type, n, k, seed=51)
    rw = repack(w)
    gen = torch.Generator().manual_seed(52)
    x = torch.randn(3, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    launch = dict(block_nb=block_nb, block_g=4, sm_count=1)
    y = persistent_gemv(x, rw, **launch)
    assert_close_to_reference(y, reference(x, w), k)
    assert torch.equal(y, tiled_gemv(x, rw, GemvConfig(block_nb=block_nb, block_g=4, split=1)))
    assert_close_to_reference(persistent_gemv(x, rw, bias=bias, **launch), reference(x, w) + bias, k)
    y16 = persistent_gemv(x.half(), rw, out_dtype=torch.float16, **launch)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), reference(x.half(), w), rtol=2e-3,
                               atol=2e-3 * reference(x, w).abs().max().item())
    for r in (0, 2):  # a row alone: the same bits as in the batch, whatever the other rows hold
        assert torch.equal(persistent_gemv(x[r:r + 1].contiguous(), rw, **launch)[0], y[r])
    assert torch.equal(persistent_gemv(x, rw, block_nb=block_nb, block_g=4, sm_count=3), y)  # more programs


def test_block_g_divides_the_groups_and_is_checked():
    assert [default_block_g(k) for k in (3584, 4864, 896, 18944, 512)] == [16, 8, 4, 16, 16]
    rw = repack(random_weight(T.Q8_0, 4, 96, seed=1))  # 3 groups
    with pytest.raises(ValueError, match="block_g=2 must divide the 3 groups"):
        persistent_gemv(torch.zeros(1, 96), rw, block_g=2)


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(3584, 3584), (4608, 3584), (3584, 18944)])
def test_matches_reference_at_7b_shapes_cuda(ggml_type, n, k):
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs a CUDA GPU and compiled kernels")
    w = random_weight(ggml_type, n, k, device="cuda", seed=53)
    rw = repack(w)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(54)).cuda()
    y = persistent_gemv(x, rw)
    assert_close_to_reference(y, reference(x, w), k)
    assert torch.equal(persistent_gemv(x[1:].contiguous(), rw)[0], y[1])


_COMPILE = r"""
import json
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton.persistent_gemv import _persistent_gemv_kernel
planes = {0: ("*fp16", "*i32", "*i32", "*i32"), 1: ("*fp16", "*fp16", "*i32", "*i32"),
          2: ("*fp16", "*i32", "*i32", "*i32"), 3: ("*fp16", "*i32", "*i32", "*i32"),
          4: ("*fp16", "*fp16", "*u8", "*u8"), 5: ("*fp16", "*i16", "*i8", "*i8")}
arch = int(sys.argv[1])
out = {}
for kind, (a, b, c, e) in planes.items():
    for even in (False, True):
        sig = {"x_ptr": "*fp16", "q_ptr": "*i32", "a_ptr": a, "b_ptr": b, "c_ptr": c, "e_ptr": e,
               "bias_ptr": "*fp32", "out_ptr": "*fp16", "M": "i32", "N": "i32", "stride_xm": "i32",
               "stride_om": "i32", "N_RB": "i32", "N_TILES": "i32", "ONES": "i32"}
        const = {"N_GROUPS": 112, "KIND": kind, "T": 8 if kind == 3 else 4, "RR": 4, "BLOCK_NB": 2, "BLOCK_G": 16,
                 "HAS_BIAS": True, "EVEN_N": even, "NUM_STAGES": 3, "PDL": arch >= 90}
        sig.update({k: "constexpr" for k in const})
        k = triton.compile(ASTSource(_persistent_gemv_kernel, sig, const), target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": 4})
        out[f"{kind}/{even}"] = k.asm["ptx"]
print(json.dumps({key: {"target": f".target sm_{arch}" in p, "bf16": "bf16" in p, "mma": "mma." in p,
                        "gdc": "griddepcontrol.wait" in p, "cp_async": "cp.async" in p}
                  for key, p in out.items()}))
"""


@pytest.mark.parametrize("arch", ["75", "90"])
def test_compiles_for_t4_sm75_and_sm90_without_bf16_or_mma(arch):
    """Every kind, masked rows or not, compiles for a T4 and an H100 without a device, with
    no bf16 and no tensor-core instructions; on the H100 with programmatic dependent launch
    and the flattened loop's weights pipelined through shared memory (cp.async)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, arch], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result) == 12
    for key, r in result.items():
        assert r["target"] and not r["bf16"] and not r["mma"] and r["gdc"] == (arch == "90"), key
        if arch == "90":
            assert r["cp_async"], f"{key}: the loop's loads are not pipelined"
