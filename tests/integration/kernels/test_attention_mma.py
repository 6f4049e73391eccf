"""The paged-attention kernel's opt-in tensor-core split body (kernels/triton/attend_split_mma.py)
against float64 attention and the default body, and its f16 pieces against the float32
values they stand for. CPU variants run under Triton's interpreter, `cuda` variants the
compiled kernel (see test_triton_paged_attention.py)."""

from __future__ import annotations

import pytest
import torch
from paged_attention_cases import MODEL_SHAPES, kernel_device, plain_attention, scattered_pages, sequence_kv
from triton_devices import DEVICES  # sets TRITON_INTERPRET before any kernel module loads

# isort: split
import triton  # noqa: E402 (after TRITON_INTERPRET is set: this file jits a kernel of its own)
import triton.language as tl  # noqa: E402

from minivllm.kernels.gpu_profile import gpu_profile  # noqa: E402
from minivllm.kernels.triton import paged_attention as pa  # noqa: E402
from minivllm.kernels.triton.attend_split_mma import dot3  # noqa: E402
from minivllm.kernels.triton.paged_attention import paged_attention  # noqa: E402


@pytest.fixture
def device(request) -> torch.device:
    return kernel_device(request.param)


def _f16_ulps(x: torch.Tensor, y: torch.Tensor) -> float:
    """Largest |x - y| in f16 spacings at the larger magnitude (normal range)."""
    x, y = x.float(), y.float()
    return float(((x - y).abs() / (torch.finfo(torch.float16).eps * torch.maximum(x.abs(), y.abs())
                                   .clamp_min(2 ** -14))).max())


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("heads,kv_heads,head_dim", MODEL_SHAPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["q-f32", "q-f16"])
def test_tensor_core_body_keeps_float32_precision(device, heads, kv_heads, head_dim, q_dtype, monkeypatch):
    """`SplitLaunch(mma=True)` (attend_split_mma.py), f16 caches: float32 queries (the
    engine's, after RoPE) within the default body's tolerance of float64 attention, so
    float32-grade (one f16 piece of q or p dropped: errors about 2^-11 relative, which
    fail); f16 queries within 2 f16 spacings of float64 as the default body is (float32
    math, then the output's f16 rounding). Float32 queries of 1e6 check the power-of-two
    scaling that keeps the pieces in f16's range. Where the GPU profile forbids tl.dot (the T4
    profile), the option is ignored: the plain body's bits. Also the engine's switch: on
    by default, off under MINIVLLM_ATTENTION_MMA=0."""
    seq_lens = [150, 70, 16, 129, 1]
    k, v, tables, table_lists = scattered_pages(seq_lens=seq_lens, page_size=16, kvh=kv_heads, dtype=torch.float16,
                                       device=device, seed=11 + head_dim, head_dim=head_dim, width=24)
    rows = [(0, 149), (2, 15), (3, 128), (4, 0), (1, 63), (1, 64)]
    q = torch.randn(len(rows), heads, head_dim, generator=torch.Generator().manual_seed(9)).to(device, q_dtype)
    q[1] *= 1e6 if q_dtype == torch.float32 else 1e4  # f32: past f16's range even after the 1/sqrt(d)
    seq = torch.tensor([r[0] for r in rows], dtype=torch.int32, device=device)
    pos = torch.tensor([r[1] for r in rows], dtype=torch.int32, device=device)
    default = paged_attention(q, k, v, tables, seq, pos, launch=pa.SplitLaunch())  # the plain body
    mma = paged_attention(q, k, v, tables, seq, pos, launch=pa.SplitLaunch(mma=True))
    if device.type == "cuda" and not gpu_profile(device).tensor_core_dot:
        assert torch.equal(mma, default)
        return
    assert torch.isfinite(mma).all()
    for i, (s, p) in enumerate(rows):
        ks, vs = sequence_kv(k, table_lists[s], p + 1), sequence_kv(v, table_lists[s], p + 1)
        exact = plain_attention(q[i].double(), ks, vs)
        if q_dtype == torch.float32:
            torch.testing.assert_close(mma[i].double(), exact, rtol=1e-5, atol=1e-5)
        else:
            assert _f16_ulps(default[i], exact) <= 2.0 and _f16_ulps(mma[i], exact) <= 2.0, i
    monkeypatch.delenv(pa.MMA_ENV, raising=False)  # the engine's launch takes it by default
    assert pa.default_launch() == pa.SplitLaunch(mma=True)
    assert torch.equal(paged_attention(q, k, v, tables, seq, pos), mma)
    monkeypatch.setenv(pa.MMA_ENV, "0")
    assert pa.default_launch() == pa.SplitLaunch()


@triton.jit
def _times_identity(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i[:, None] * N + i[None, :])
    eye = tl.where(i[:, None] == i[None, :], 1.0, 0.0).to(tl.float16)
    tl.store(out_ptr + i[:, None] * N + i[None, :], dot3(x, eye))


@pytest.mark.parametrize("device", DEVICES, indirect=True)
def test_three_f16_pieces_carry_every_float32_bit(device):
    """attend_split_mma.dot3 times an identity matrix gives back its float32 operand bit
    for bit: hi + mid / 2^11 + lo / 2^22 is the float32 value exactly, full 24-bit
    mantissas included (dropping lo loses the last bits, which this sees and the
    attention tolerances cannot)."""
    if device.type == "cuda" and not gpu_profile(device).tensor_core_dot:
        pytest.skip("tl.dot: not on this profile (the body is never chosen here)")
    gen = torch.Generator().manual_seed(3)
    x = (torch.rand(16, 16, generator=gen, dtype=torch.float64) * 4 - 2).float()  # (-2, 2), all 24 bits
    x[0, :4] = torch.tensor([1.9999999, -1.0000001, 2.0 ** -14 + 2.0 ** -37, 0.0])
    x = x.to(device)
    out = torch.empty_like(x)
    _times_identity[(1,)](x, out, N=16)
    assert torch.equal(out, x)
