"""The GPU profile (kernels/gpu_profile.py): MINIVLLM_GPU_PROFILE=sm75 makes every
capability-based choice the T4's, on any machine.

Checked against the T4's published facts (sm_75, 40 SMs, no bf16 arithmetic) and by
which kernel the repacked GEMV dispatch actually calls under each profile.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T  # noqa: E402
from test_triton_gemv import random_weight  # noqa: E402
from triton_devices import INTERPRETED  # sets TRITON_INTERPRET before any kernel module loads

from minivllm.errors import ConfigError  # noqa: E402
from minivllm.kernels.gpu_profile import PROFILE_ENV, gpu_profile  # noqa: E402


def test_sm75_profile_is_a_t4(monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "sm75")
    p = gpu_profile()
    assert (p.name, p.capability, p.table_key, p.sm_count) == ("sm75", (7, 5), "sm75", 40)
    monkeypatch.delenv("MINIVLLM_Q8_GEMV", raising=False)
    assert not p.bf16 and not p.tensor_core_dot and not p.int8_gemv  # lower precision only by name
    monkeypatch.setenv("MINIVLLM_Q8_GEMV", "1")
    assert p.int8_gemv


def test_native_profile_uses_the_device_or_sm90_without_one(monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.delenv("MINIVLLM_Q8_GEMV", raising=False)
    p = gpu_profile()
    assert p.name == "native"
    if torch.cuda.is_available():
        assert p.capability == torch.cuda.get_device_capability()
    else:
        assert p.capability == (9, 0) and p.bf16 and not p.int8_gemv


def test_unknown_profile_is_refused_naming_the_setting(monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, "sm61")
    with pytest.raises(ConfigError, match=PROFILE_ENV):
        gpu_profile()


@pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(), reason="needs the interpreter or a GPU")
@pytest.mark.parametrize("profile", ["sm75", "native"])
@pytest.mark.parametrize("expect_q8", [True, False], ids=["q8-asked", "default"])
def test_repacked_dispatch_takes_the_int8_path_only_when_asked(monkeypatch, profile, expect_q8):
    from minivllm.kernels.repacked_layout import repack
    from minivllm.kernels.triton import q8_gemv as q8
    from minivllm.kernels.triton import tiled_gemv as tg
    from minivllm.kernels.triton.repacked_gemv import repacked_gemv

    monkeypatch.setenv(PROFILE_ENV, profile)
    if expect_q8:
        monkeypatch.setenv("MINIVLLM_Q8_GEMV", "1")
    else:
        monkeypatch.delenv("MINIVLLM_Q8_GEMV", raising=False)
    device = "cpu" if INTERPRETED else "cuda"
    called = []
    real_q8, real_tiled = q8.q8_gemv, tg.tiled_gemv
    monkeypatch.setattr(q8, "q8_gemv", lambda *a, **k: called.append("q8") or real_q8(*a, **k))
    monkeypatch.setattr(tg, "tiled_gemv", lambda *a, **k: called.append("tiled") or real_tiled(*a, **k))
    w = repack(random_weight(T.Q4_K, 8, 256, device=device, seed=51))
    x = torch.randn(1, 256, device=device).half()
    y = repacked_gemv(x, w)
    ref = x.float() @ w.dequantize(torch.float32).T
    assert called == (["q8"] if expect_q8 else ["tiled"])
    # int8 activations (per-group scale max|x|/127) cost at most ~1% relative error here.
    assert ((y - ref).norm() / ref.norm()).item() < (2e-2 if expect_q8 else 1e-5)
    # float32 activations keep the float kernel on every profile (float32 means float32).
    called.clear()
    repacked_gemv(x.float(), w)
    assert called == ["tiled"]


@pytest.mark.cuda
def test_sm75_profile_refuses_bf16_on_any_gpu(monkeypatch):
    from minivllm.devices import check_dtype_supported
    from minivllm.errors import DeviceError

    monkeypatch.setenv(PROFILE_ENV, "sm75")
    with pytest.raises(DeviceError, match="sm_75"):
        check_dtype_supported(torch.device("cuda"), torch.bfloat16)
    check_dtype_supported(torch.device("cuda"), torch.float16)
