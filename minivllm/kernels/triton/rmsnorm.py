"""Row-wise RMSNorm as a Triton kernel: one program per row, float32 statistics.

Same numerics contract as `minivllm.kernels.rmsnorm.rms_norm` (input upcast before the
sum of squares, result float32), but row-invariant by construction: every row is
reduced by its own program over one fixed block (the next power of two ≥ d), so its
result never depends on how many rows are in the batch. torch's CUDA reduction may
split the same row differently for M=1 and M=8, which makes a request's logits depend
on what else is batched with it.

T4-safe: float32 arithmetic only; bf16 input is accepted only on sm_80+.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.errors import ConfigError, DeviceError
from minivllm.kernels.triton.paged_attention import require_triton_device
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers

# One block must hold a whole row; wider rows would spill registers badly (no model
# minivllm loads is near this: Qwen2.5-7B has d = 3584).
_MAX_BLOCK = 1 << 15


@triton.jit
def _rms_norm_rows_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n_cols, eps, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Same operation order as the torch reference: (x * rsqrt(var + eps)) * w.
    y = x * tl.rsqrt(variance + eps) * w
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (..., d) float32/float16/bfloat16; weight: (d,). Returns float32 of x's shape."""
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ConfigError("rms_norm weight", tuple(weight.shape), f"expected ({d},) to match the input's last dim")
    block = triton.next_power_of_2(d)
    if block > _MAX_BLOCK:
        raise ConfigError(
            "rms_norm width",
            d,
            f"rms_norm_rows handles rows up to {_MAX_BLOCK} wide; use minivllm.kernels.rmsnorm.rms_norm",
        )
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"rms_norm {name} dtype", t.dtype, "expected float32, float16 or bfloat16")
        from minivllm.kernels.gpu_profile import gpu_profile

        if t.dtype == torch.bfloat16 and t.is_cuda and not gpu_profile(t.device).bf16:
            major, minor = gpu_profile(t.device).capability
            raise DeviceError(
                f"rms_norm_rows: bfloat16 {name} needs an sm_80+ GPU, but {t.device} is sm_{major}{minor} "
                f"(e.g. a T4); use --activation-dtype f16 or f32 (dtype='float16' / 'float32') on this GPU"
            )
    require_triton_device({"x": x, "weight": weight}, "rms_norm_rows")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()  # the kernel reads each row as one contiguous block
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        _rms_norm_rows_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), d, float(eps), BLOCK=block, **pdl_args(x.device)
        )
    return out.view(x.shape)
