"""Device and activation-dtype names as users type them, resolved and checked once.

`--inference-device` accepts `cpu`, `gpu` (the CUDA device with the most free memory,
so two workers started one after the other land on different GPUs), `cuda` (same as
`gpu`) and `cuda:N`. Nothing here assumes `cuda:0`.
"""

from __future__ import annotations

import torch

from minivllm.errors import ConfigError, DeviceError

_DTYPES = {
    "f32": torch.float32, "float32": torch.float32, "fp32": torch.float32,
    "f16": torch.float16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
DTYPE_CHOICES = ("f32", "f16", "bf16")


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ConfigError("dtype", name, f"allowed: {', '.join(DTYPE_CHOICES)}")
    key = str(name).lower()
    if key not in _DTYPES:
        raise ConfigError("dtype", name, f"allowed: {', '.join(DTYPE_CHOICES)} (or float32/float16/bfloat16)")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]


def resolve_device(name: str | torch.device) -> torch.device:
    spec = str(name).lower()
    if spec == "cpu":
        return torch.device("cpu")
    if spec in ("gpu", "cuda") or spec.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"inference device {name!r} needs an NVIDIA GPU, but torch sees none "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use --inference-device cpu"
            )
        count = torch.cuda.device_count()
        if spec.startswith("cuda:"):
            try:
                index = int(spec.split(":", 1)[1])
            except ValueError:
                raise ConfigError("inference_device", name, "expected cpu, gpu, cuda or cuda:N") from None
            if not 0 <= index < count:
                raise DeviceError(
                    f"inference device {name!r} does not exist; this machine has cuda:0..cuda:{count - 1}"
                )
            return torch.device("cuda", index)
        free = [torch.cuda.mem_get_info(i)[0] for i in range(count)]
        return torch.device("cuda", max(range(count), key=lambda i: free[i]))
    raise ConfigError("inference_device", name, "expected cpu, gpu, cuda or cuda:N")


def check_dtype_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse bf16 on GPUs without bf16 arithmetic (T4 is sm_75; bf16 needs sm_80+)."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        from minivllm.kernels.gpu_profile import gpu_profile

        profile = gpu_profile(device)  # MINIVLLM_GPU_PROFILE=sm75 refuses bf16 on any GPU, as a T4 must
        if not profile.bf16:
            major, minor = profile.capability
            name = torch.cuda.get_device_name(device)
            forced = f", GPU profile {profile.name}" if profile.name != "native" else ""
            raise DeviceError(
                f"activation dtype bf16 is not supported on {name} (sm_{major}{minor}{forced}); bf16 needs "
                f"sm_80 or newer. Use --activation-dtype f16 (or f32) on this GPU."
            )


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
    return "cpu"
