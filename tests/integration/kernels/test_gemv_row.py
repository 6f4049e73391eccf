"""`bench kernels --row` (bench/gemv_row.py) launches each 7B role's GEMV the way a decode
step does: q+k+v summed, o and down as unsummed split-K slices for the next norm, gate+up
with SwiGLU in the epilogue. Under Triton's interpreter on the CPU each launcher's result is
checked against the float32 product of the dequantized weight; the row's summary against
hand-made figures."""

from __future__ import annotations

import pytest
import torch
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.bench.gemv_row import launcher, summary  # noqa: E402
from minivllm.kernels.triton.repacked_gemv import tiled_config  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors run the kernels under the interpreter")


def _weight(name: str, n: int, k: int):
    from gguf import GGMLQuantizationType

    from minivllm.bench.kernels import random_weight
    from minivllm.kernels.repacked_layout import repack

    w = repack(random_weight(GGMLQuantizationType[name], n, k, device=torch.device("cpu"), seed=5))
    return w, w.dequantize(torch.float32)


def _summed(y) -> torch.Tensor:
    """A tensor as is; split-K partials summed over their slices (what the next norm does)."""
    return y.float() if isinstance(y, torch.Tensor) else y.ws.sum(0)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
@pytest.mark.parametrize("role", ["qkv", "o", "down"])
def test_each_projection_is_the_product(name, role):
    """K = 2048 splits in two here, so o and down must hand back unsummed slices, as
    `QuantLinear.partials` does in the engine, and q+k+v the summed output."""
    w, dense = _weight(name, 64, 2048)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(7)).half()
    out = launcher(role, x, w)()
    assert tiled_config(x, w, invariant=False).split == 2
    assert isinstance(out, torch.Tensor) == (role == "qkv")
    y = _summed(out)
    ref = x.float() @ dense.T
    assert y.shape == (1, 64)
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
def test_gate_up_carries_swiglu(name):
    w, dense = _weight(name, 128, 512)
    # small inputs: gate x up of random weights passes f16's 65,504 from inputs of unit scale
    x = (0.1 * torch.randn(1, 512, generator=torch.Generator().manual_seed(7))).half()
    y = launcher("gate+up", x, w)().float()
    gu = x.float() @ dense.T
    ref = torch.nn.functional.silu(gu[:, :64]) * gu[:, 64:]
    assert y.shape == (1, 64)
    assert torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_summary_takes_each_types_lowest_role():
    rows = [{"type": "Q4_K", "role": r, "early1_frac_of_copy": f, "early2_frac_of_copy": g}
            for r, f, g in (("qkv", 0.45, 0.5), ("o", 0.40, 0.62), ("gate+up", 0.8, 0.7), ("down", 0.66, 0.61))]
    s = summary(rows, [1, 2])["Q4_K"]
    assert s["early1"] == {"min": 0.40, "median": pytest.approx(0.555), "lowest_role": "o"}
    assert s["early2"]["min"] == 0.5 and s["early2"]["lowest_role"] == "qkv"


@pytest.mark.parametrize("early, shapes, says", [
    ([3], None, "--early 3: weight trips loaded before the PDL wait run from 0 to 2"),
    ([], None, "run from 0 to 2"),
    ([1], [(64, 64)], "leave out --shapes"),
])
def test_the_row_refuses_what_it_cannot_time_by_name(capsys, early, shapes, says):
    from minivllm.bench.drivers.kernels import Settings, run

    assert run(Settings(types=None, shapes=shapes, inference_device="gpu", batch_rows=8, row=True, early=early)) == 2
    assert says in capsys.readouterr().out
