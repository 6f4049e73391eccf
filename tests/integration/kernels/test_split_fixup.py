"""The split GEMV that sums its own slices (`MINIVLLM_SPLIT_FIXUP=1`,
split_sum.last_slice_sums): the same bits as the second launch it replaces.

Reference: the same GEMV with the fixup off, whose partials `tiled_gemv._sum_splits_kernel`
adds in slice order (itself checked against torch's dequantized reference in
test_triton_tiled_gemv.py). Same partials, same order, same rounding: the outputs must be
equal bit for bit, with or without a bias, in float32 and float16, at M = 1 and M = 3,
and the tickets must be back at zero after every launch (else the next launch's last
program would sum too early or never). CPU cases run Triton's interpreter; `cuda` ones
repeat many launches, where programs really race for the last ticket.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import assert_close_to_reference, random_weight, reference  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.kernels.gemv_configs import GemvConfig  # noqa: E402
from minivllm.kernels.repacked_layout import repack  # noqa: E402
from minivllm.kernels.triton import split_sum  # noqa: E402
from minivllm.kernels.triton.tiled_gemv import tiled_gemv  # noqa: E402

cpu_only = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")


def _both(monkeypatch, x, rw, config, **kw):
    monkeypatch.setenv(split_sum.FIXUP_ENV, "0")
    two_launches = tiled_gemv(x, rw, config, **kw)
    # The workspace comes from torch.empty, which hands back the memory just freed: leave
    # other partials there (of -3x), so on a GPU a program that summed before every slice
    # had been stored would add stale numbers and show, instead of the reference's own.
    # (The interpreter runs programs one after another: there, the last program always
    # sums last, so it checks the arithmetic and the tickets, not the race.)
    tiled_gemv(-3 * x, rw, config, **kw)
    monkeypatch.setenv(split_sum.FIXUP_ENV, "1")
    one_launch = tiled_gemv(x, rw, config, **kw)
    return two_launches, one_launch


def _tickets_zero() -> bool:
    return all(int(buf.abs().sum()) == 0 for buf in split_sum._TICKETS.values())


@cpu_only
# The sum is the epilogue's, the same for every type: two types, each with one split count
# (interpreted launches are slow, and CI's time is bounded).
@pytest.mark.parametrize("ggml_type, split", [(T.Q4_K, 3), (T.Q6_K, 2)], ids=["Q4_K-3", "Q6_K-2"])
def test_in_launch_sum_is_the_second_launchs_bits_interpreted(monkeypatch, ggml_type, split):
    n, k = 21, 768  # 21 rows: a partial row group and a partial tile; 24 groups in 2 or 3 slices
    w = random_weight(ggml_type, n, k, seed=51)
    rw = repack(w)
    gen = torch.Generator().manual_seed(52)
    config = GemvConfig(block_nb=2, block_g=4, split=split)
    for m in (1, 3):
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen)
        for kw in ({}, {"bias": bias}, {"out_dtype": torch.float16}):
            xx = x.half() if kw.get("out_dtype") is torch.float16 else x
            two, one = _both(monkeypatch, xx, rw, config, **kw)
            assert one.dtype == two.dtype and one.shape == (m, n)
            assert torch.equal(one, two), (m, kw)
            assert _tickets_zero()
    monkeypatch.setenv(split_sum.FIXUP_ENV, "1")
    assert_close_to_reference(tiled_gemv(x, rw, config), reference(x, w), k)


@cpu_only
def test_deferred_partials_and_unsplit_launches_ignore_the_switch(monkeypatch):
    w = random_weight(T.Q4_K, 8, 512, seed=53)
    rw = repack(w)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(54))
    monkeypatch.setenv(split_sum.FIXUP_ENV, "1")
    deferred = tiled_gemv(x, rw, GemvConfig(block_nb=1, block_g=4, split=2), defer_split_sum=True)
    assert isinstance(deferred, split_sum.SplitPartials) and deferred.split == 2
    assert torch.equal(tiled_gemv(x, rw, GemvConfig(block_nb=1, block_g=4, split=1)),
                       _both(monkeypatch, x, rw, GemvConfig(block_nb=1, block_g=4, split=1))[0])


@pytest.mark.cuda
@pytest.mark.parametrize("ggml_type", [T.Q4_K, T.Q8_0], ids=lambda t: t.name)
def test_in_launch_sum_is_the_second_launchs_bits_cuda(monkeypatch, ggml_type):
    """The fused QKV's shape (4608 x 3584) at split 2 and 4, 50 launches each, the
    weights' tiles racing for their last ticket every time."""
    w = random_weight(ggml_type, 4608, 3584, device="cuda", seed=55)
    rw = repack(w)
    gen = torch.Generator().manual_seed(56)
    for config in (GemvConfig(block_nb=4, block_g=32, split=2), GemvConfig(block_nb=8, block_g=32, split=4,
                                                                             num_warps=8)):
        x = torch.randn(1, 3584, generator=gen).cuda().half()
        bias = torch.randn(4608, generator=gen).cuda()
        two, _ = _both(monkeypatch, x, rw, config, bias=bias, out_dtype=torch.float16)
        for _ in range(50):
            _, one = _both(monkeypatch, x, rw, config, bias=bias, out_dtype=torch.float16)
            assert torch.equal(one, two)
        torch.cuda.synchronize()
        assert _tickets_zero()


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels.triton.tiled_gemv import _tiled_gemv_kernel
arch = int(sys.argv[1])
sig = {"x_ptr": "*fp16", "q_ptr": "*i32", "a_ptr": "*fp16", "b_ptr": "*fp16", "c_ptr": "*u8", "e_ptr": "*u8",
       "bias_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32", "stride_om": "i32",
       "stride_os": "i32", "G_PER_SPLIT": "i32", "N_RB": "i32", "PAIR_RB": "i32", "ONES": "i32"}
const = {"N_GROUPS": 112, "KIND": 4, "T": 4, "RR": 4, "BLOCK_NB": 4, "BLOCK_G": 32, "IS_SPLIT": True,
         "HAS_BIAS": True, "PAIRED": False, "ROUND": 0, "PDL": arch >= 90, "EVEN_N": False, "EARLY": 0,
         "FIXUP": True, "SPLIT": 2, "T_OUTER": False}
sig.update({k: "constexpr" for k in const})
sig.update({"ticket_ptr": "*i32", "final_ptr": "*fp16"})
k = triton.compile(ASTSource(_tiled_gemv_kernel, sig, const), target=GPUTarget("cuda", arch, 32),
                   options={"num_warps": 4, "num_stages": 2})
p = k.asm["ptx"]
print(json.dumps({"target": f".target sm_{arch}" in p, "ticket": "atom.global.gpu.acq_rel.add" in p,
                  "l2_only": "ld.global.cg" in p, "bf16": "bf16" in p}))
"""


@pytest.mark.parametrize("arch", ["75", "90"])
def test_in_launch_sum_compiles_for_t4_sm75_and_sm90(arch):
    """The ticket is an acquire-release atomic at GPU scope and the slices are read past
    L1 (`.cg`), on a T4 and an H100, compiled here without a device."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, arch], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"target": True, "ticket": True, "l2_only": True,
                                                                 "bf16": False}
