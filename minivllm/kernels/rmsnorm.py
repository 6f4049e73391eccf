"""RMSNorm with its statistics in float32 whatever the activation dtype.

f16 activations overflow in the sum of squares on wide models (Qwen2.5-7B prints
"!!!!" otherwise), so the input is upcast before the reduction, and the result is
returned in float32: the caller decides when to drop to the matmul dtype.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # On CPU in float32: one compiled call instead of five torch ops (their per-op overhead
    # is what costs in decode). Every row count takes it: choosing the kernel by the number
    # of rows would make a row's rounding depend on its batch and prefill chunking, which
    # batch-invariant mode promises it does not.
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and weight.dtype == torch.float32:
        from minivllm.kernels.cpu_gemv import rms_norm_f32

        out = rms_norm_f32(x, weight, eps)  # the same float32 math in one compiled call, or None
        if out is not None:
            return out
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return x32 * torch.rsqrt(variance + eps) * weight.float()
