"""Which GPU the kernels choose for: the one home of every capability-based choice.

`MINIVLLM_GPU_PROFILE=sm75` makes the engine choose, on any NVIDIA GPU, exactly what it
would choose on a T4 (sm_75): f16 activations (bf16 refused), no `tl.dot`, the T4's GEMV
launch table (`gemv_configs.json`, key "sm75"). So the T4 path can be run and tested on a
lent H100/H200. The int8-activation (`dp4a`) GEMV is never a default, a T4's included: it
rounds activations to 8 bits, a precision nobody asked for by choosing f16, so it runs only
under its own name (`MINIVLLM_Q8_GEMV=1`).
Unset (or `native`), the device's own capability decides.

Why a profile and not per-call checks: the choices (dtype, GEMV kernel, config table)
are made in several modules; reading them all from one `GpuProfile` keeps the T4 path
one thing that a test can switch on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from minivllm.errors import ConfigError

PROFILE_ENV = "MINIVLLM_GPU_PROFILE"
# The profiles a user can ask for, with the capability each stands for.
_PROFILES = {"sm75": (7, 5)}
_PROFILE_SMS = {"sm75": 40}  # a T4's multiprocessors (the GEMV's default split-K reads it)


@dataclass(frozen=True)
class GpuProfile:
    name: str  # "native" or a forced profile ("sm75")
    capability: tuple[int, int]  # what the choices assume (the forced one, or the device's)
    table_key: str  # the row of gemv_configs.json: "sm75", "sm90", ...
    sm_count: int  # multiprocessors the launch shapes are sized for

    @property
    def bf16(self) -> bool:
        return self.capability >= (8, 0)

    @property
    def tensor_core_dot(self) -> bool:
        """Whether kernels may use `tl.dot`: only the opt-in tensor-core attention body
        (`SplitLaunch(mma=True)`) does; every default kernel also runs on sm_75."""
        return self.capability >= (8, 0)

    @property
    def programmatic_launch(self) -> bool:
        """Whether kernels may be launched with programmatic dependent launch (sm_90+;
        `kernels/triton/pdl.py`, unless MINIVLLM_PDL=0)."""
        return self.capability >= (9, 0)

    @property
    def int8_gemv(self) -> bool:
        """The int8-activation GEMV, for f16/bf16 activations (float32 stays float32), on
        every profile only when asked for by name (MINIVLLM_Q8_GEMV=1): it rounds
        activations to 8 bits per group as llama.cpp does, a lower precision than the f16
        the user chose. On a T4 it is likely the faster path (its float32 FMA rate makes
        the float decode compute-bound there), which is why the T4 profile's runs report
        it beside the float one."""
        return os.environ.get("MINIVLLM_Q8_GEMV") == "1"


def requested_profile() -> str:
    name = os.environ.get(PROFILE_ENV, "native").strip().lower() or "native"
    if name != "native" and name not in _PROFILES:
        raise ConfigError(PROFILE_ENV, name, f"allowed: native, {', '.join(sorted(_PROFILES))}")
    return name


def gpu_profile(device=None) -> GpuProfile:
    """The profile for `device` (a CUDA device; None: the current one). Without CUDA (the
    Triton interpreter on CPU) the native profile assumes an sm_90 with 132 SMs. Not
    cached: torch caches the device properties, and tests patch them."""
    name = requested_profile()
    if name != "native":
        cap = _PROFILES[name]
        return GpuProfile(name, cap, f"sm{cap[0]}{cap[1]}", _PROFILE_SMS[name])
    import torch

    is_cuda = getattr(device, "type", None) == "cuda" or (device is None and torch.cuda.is_available())
    if not is_cuda:
        return GpuProfile("native", (9, 0), "sm90", 132)
    cap = tuple(torch.cuda.get_device_capability(device))
    try:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    except (RuntimeError, AssertionError):  # a patched capability on a machine without CUDA (tests)
        sms = 132
    return GpuProfile("native", cap, f"sm{cap[0]}{cap[1]}", sms)


# The GPU code path on CPU tensors: with Triton's interpreter (TRITON_INTERPRET=1) and
# MINIVLLM_TRITON_CPU=1, a model on the CPU runs what it would run on CUDA (repacked
# GEMVs, fused projections, the fused layer kernels), slowly, so that path can be tested
# on a machine without a GPU.
TRITON_CPU_ENV = "MINIVLLM_TRITON_CPU"


def triton_interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1): on CPU
    tensors, with no compiler, no inline PTX and no autotuning."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_gpu_path(device) -> bool:
    """Whether a model on `device` takes the GPU code path: CUDA, or the CPU under the
    interpreter when MINIVLLM_TRITON_CPU=1."""
    kind = getattr(device, "type", str(device))
    if kind == "cuda":
        return True
    return kind == "cpu" and os.environ.get(TRITON_CPU_ENV) == "1" and triton_interpreting()
