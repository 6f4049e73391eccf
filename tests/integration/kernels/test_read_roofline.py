"""The read-roofline kernel of the GEMV sweep (bench/read_roofline.py): it must read every
word once, so its per-block sums equal torch's (int64 sums wrapped to int32), with a last
block past the end; and it compiles for a T4 and an H100 without a device (for the H100 with
programmatic dependent launch, its reads before its wait)."""

from __future__ import annotations

import pytest
import torch
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.bench.read_roofline import BLOCK, partial_sums  # noqa: E402


def wrapped_block_sums(words: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(-(-words.numel() // BLOCK) * BLOCK, dtype=torch.int64)
    padded[:words.numel()] = words.to(torch.int64)
    sums = padded.view(-1, BLOCK).sum(dim=1) % (1 << 32)
    return torch.where(sums >= 1 << 31, sums - (1 << 32), sums).to(torch.int32)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (no GPU here)")
@pytest.mark.parametrize("n", [2 * BLOCK + 1000, 3 * BLOCK], ids=["partial-last-block", "whole-blocks"])
def test_every_word_is_read_once(n):
    gen = torch.Generator().manual_seed(7)
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32, generator=gen)
    assert torch.equal(partial_sums(words), wrapped_block_sums(words))


def test_refuses_what_it_cannot_read_as_words():
    with pytest.raises(ValueError, match="int32"):
        partial_sums(torch.zeros(8, dtype=torch.int64))


_COMPILE = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.bench.read_roofline import BLOCK, _read_kernel
arch = int(sys.argv[1])
sig = {"x_ptr": "*i32", "out_ptr": "*i32", "n": "i32", "BLOCK": "constexpr", "EVEN": "constexpr", "PDL": "constexpr"}
# x_ptr 16-byte aligned, as Triton specializes a torch allocation's pointer at launch
src = ASTSource(_read_kernel, sig, {"BLOCK": BLOCK, "EVEN": True, "PDL": arch >= 90},
                attrs={(0,): [["tt.divisibility", 16]]})
k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
p = k.asm["ptx"]
wait = p.find("griddepcontrol.wait")
print(json.dumps({"target": f".target sm_{arch}" in p, "wide": "ld.global" in p and ".v4" in p,
                  "reads_before_wait": wait > 0 and "ld.global" in p[:wait]}))
"""


@pytest.mark.parametrize("arch", ["75", "90"])
def test_compiles_for_t4_sm75_and_sm90_with_wide_loads(arch):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE, arch], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # on the H100 compiled with PDL, as the sweep's `pdl=True` launch: the reads come before the wait
    assert result == {"target": True, "wide": True, "reads_before_wait": arch == "90"}
