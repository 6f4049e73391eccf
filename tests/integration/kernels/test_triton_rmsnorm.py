"""The row-wise Triton RMSNorm against the torch reference and float64 math.

CPU variants run through Triton's interpreter (switched on only where there is no GPU,
since it is read when the kernel module is imported); `cuda` variants run the compiled
kernel.
"""

from __future__ import annotations

import pytest
import torch
from triton_devices import DEVICES, INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.errors import ConfigError, DeviceError  # noqa: E402
from minivllm.kernels.gpu_profile import gpu_profile  # noqa: E402 (the T4 profile decides as a T4 would)
from minivllm.kernels.rmsnorm import rms_norm  # noqa: E402
from minivllm.kernels.triton.rmsnorm import rms_norm_rows  # noqa: E402


@pytest.fixture
def device(request) -> torch.device:
    if request.param == "cuda" and INTERPRETED:
        pytest.fail("TRITON_INTERPRET=1 was set before the kernel was imported, so this CUDA test would run the "
                    "interpreter instead of the compiled kernel; run this file on its own without TRITON_INTERPRET")
    return torch.device(request.param)


def _float64_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _skip_bf16_below_sm80(dtype, device):
    if dtype == torch.bfloat16 and device.type == "cuda" and gpu_profile(device).capability < (8, 0):
        pytest.skip("bf16 is refused below sm_80 (tested in test_bf16_refused_below_sm80)")


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [576, 896, 64, 100])  # SmolLM2, Qwen 0.5B hidden sizes; a head; not a power of two
def test_matches_reference(device, dtype, d):
    _skip_bf16_below_sm80(dtype, device)
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(5, d, generator=gen) * 4).to(dtype).to(device)
    w = (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype).to(device)
    out = rms_norm_rows(x, w, 1e-6)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), _float64_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_leading_dims_eps_and_strided_rows(device):
    x = torch.randn(2, 3, 96, device=device)
    w = torch.randn(96, device=device)
    out = rms_norm_rows(x, w, 0.5)  # a large eps, so a dropped or misplaced eps shows
    torch.testing.assert_close(out.double(), _float64_rms_norm(x, w, 0.5), rtol=1e-5, atol=1e-5)
    wide = torch.randn(4, 200, device=device)
    view = wide[:, 10:106]  # rows with a stride larger than their width
    torch.testing.assert_close(
        rms_norm_rows(view, w, 1e-5).double(), _float64_rms_norm(view, w, 1e-5), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_rows_are_batch_invariant_bitwise(device):
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(3)).to(device)
    w = torch.randn(576).to(device)
    full = rms_norm_rows(x, w, 1e-5)
    for rows in ([0], [5], list(range(8)), [36, 2, 5]):
        part = rms_norm_rows(x[rows], w, 1e-5)
        for j, i in enumerate(rows):
            assert torch.equal(part[j], full[i]), f"row {i} differs in a batch of {len(rows)}"


def test_bad_inputs_get_clear_errors(monkeypatch):
    x = torch.zeros(2, 64)
    with pytest.raises(ConfigError, match="weight.*expected \\(64,\\)"):
        rms_norm_rows(x, torch.zeros(32), 1e-5)
    with pytest.raises(ConfigError, match="dtype"):
        rms_norm_rows(x.double(), torch.zeros(64), 1e-5)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(DeviceError, match="Triton GPU kernel.*CUDA device"):
        rms_norm_rows(x, torch.zeros(64), 1e-5)


@pytest.mark.cuda
def test_bf16_refused_below_sm80():
    if gpu_profile().capability >= (8, 0):
        pytest.skip("this GPU supports bf16 (sm_80+); the refusal is for T4-class GPUs")
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(DeviceError, match="bfloat16.*sm_80"):
        rms_norm_rows(x, torch.ones(64, device="cuda"), 1e-5)
