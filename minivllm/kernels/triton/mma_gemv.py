"""The decode GEMV on tensor cores, for Q4_K weights and f16 activations (opt-in:
MINIVLLM_GEMV_KERNEL=mma; sm_80+ profiles with `tl.dot`, never the T4 profile).

Why: on an H100 the float GEMV (`tiled_gemv.py`) is compute-bound, not memory-bound. Each
weight costs a shift, an and/or, a float subtract and an FMA on the FP32 pipe; on the
39 MB Q4_K 18944 x 3584 matrix it takes 24.6 µs where the int8-activation kernel, same
layout and loads, takes 15.9 µs (benchmarks/results/h100-gemv-sweep-sm90-20261205.md).
Here the multiply-adds go to the tensor cores, and the decode is two instructions for
every two weights.

Exact, not a lower precision: a Q4_K weight is d * sc * q - dmin * mn, with q < 16 and the
group scale sc < 64, so q * sc < 1024 is an integer f16 holds exactly; the f16 activations
are exact too. A superblock's 256 products (q * sc) * x are exact on the tensor cores and
summed in float32, then scaled by d once; the mins term, dmin * sum_g mn_g * sum(x in g),
is float32 on the CUDA cores. Other bits than the float kernel's (another summation
order), float32-grade like it (tests/integration/kernels/test_mma_gemv.py: float64
references).

The decode of a word `w` (8 nibbles, fields p and p + 4 at bits 4p and 16 + 4p):

    v  = ((w >> 4p) & 0x000F000F) | 0x64006400    # two f16 in one word: 1024 + q, 1024 + q'
    qs = fma.f16x2(v, (sc, sc), (-1024 sc, -1024 sc))    # (q sc, q' sc), exact

(`tl.inline_asm_elementwise`; under the Triton interpreter the same values come from
plain integer arithmetic). A program's tile is BLOCK_NB row groups (4 rows each) over
one superblock a trip; the dot's K order follows the words' layout and the activations
are loaded in the same order. The activation rows are the dot's N dimension, padded to
16: a row's result never depends on the others or on M (batch-invariant with a fixed
BLOCK_NB and split).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from minivllm.kernels.gemv_configs import GEMV_KERNEL_ENV
from minivllm.kernels.gpu_profile import triton_interpreting
from minivllm.kernels.repacked_layout import R, RepackedWeight
from minivllm.kernels.triton.attend_split_mma import dot3
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers
from minivllm.kernels.triton.split_sum import SplitPartials

MMA_N = tl.constexpr(16)  # tl.dot's smallest N: the activation rows, padded


@triton.jit
def _weights_f16(w, shift, sc, ASM: tl.constexpr):
    """Fields at bits `shift` and 16 + `shift` of the words `w`, times the group scale
    `sc` (int32), as two f16 tensors of exact integers."""
    if ASM:
        scf = sc.to(tl.float16)
        one = scf.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        neg = (scf * -1024.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        v = ((w >> shift) & 0x000F000F) | 0x64006400
        r = tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r",
                                      [v, tl.broadcast_to(one | (one << 16), v.shape),
                                       tl.broadcast_to(neg | (neg << 16), v.shape)],
                                      dtype=tl.int32, is_pure=True, pack=1)
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [r],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo = (((w >> shift) & 15) * sc).to(tl.float16)
        hi = (((w >> (shift + 16)) & 15) * sc).to(tl.float16)
    return lo, hi


@triton.jit(do_not_specialize=["M", "N", "SB_PER_SPLIT"])
def _mma_gemv_q4k_kernel(
    x_ptr, q_ptr, d_ptr, dmin_ptr, sc_ptr, mn_ptr, bias_ptr, out_ptr,
    M, N, stride_xm, stride_om, stride_os, SB_PER_SPLIT,
    N_GROUPS: tl.constexpr, BLOCK_NB: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ASM: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Rows pid_n * 4 BLOCK_NB .. of out[M, N] (split: slice pid_s's float32 partials into
    the workspace [SPLIT, M, N]) for activation rows pid_m * MMA_N .. + MMA_N - 1. Every
    tile is MMA_N activation rows wide whatever M is: a reduction's order follows its
    tile's shape, so a narrower tile for a smaller batch would change a row's bits."""
    wait_for_producers(PDL)
    ROWS: tl.constexpr = 4 * BLOCK_NB
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    m0 = tl.program_id(2) * MMA_N
    n_sb: tl.constexpr = N_GROUPS // 8
    # The word tile [NB, R, G, T] of one superblock (G = 8 groups of T = 4 words), and
    # the field pairs (PP: p and p + 4) as a fifth axis: K index ((g * 4 + t) * 4 + pp) * 2 + half.
    nb = (pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB))[:, None, None, None, None]
    r = tl.arange(0, 4)[None, :, None, None, None]
    g = tl.arange(0, 8)[None, None, :, None, None]
    t = tl.arange(0, 4)[None, None, None, :, None]
    pp = tl.arange(0, 4)[None, None, None, None, :]
    nb_ok = nb < tl.cdiv(N, 4)
    # The activations in the dot's K order: element g * 32 + (pp + 4 half) * 4 + t.
    xe = tl.arange(0, 8)[:, None, None] * 32 + tl.arange(0, 4)[None, None, :] * 4 + tl.arange(0, 4)[None, :, None]
    xe = tl.reshape(tl.join(xe, xe + 16), [256])
    m = tl.arange(0, MMA_N)
    m_ok = (m0 + m) < M
    # For the mins: which group each K index is in (the K order keeps a group's 32
    # elements together), as a 0/1 matrix whose product with the activations tile sums
    # them by group, G padded to tl.dot's 16 rows.
    in_group = (tl.arange(0, 16)[:, None] == tl.arange(0, 256)[None, :] // 32).to(tl.float16)
    rows = (pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB))[:, None] * 4 + tl.arange(0, 4)[None, :]  # [NB, R]
    flat = tl.reshape(rows, [ROWS])
    ok = flat < N
    y = tl.zeros([ROWS, MMA_N], dtype=tl.float32)
    y_min = tl.zeros([ROWS, MMA_N], dtype=tl.float32)
    sb_lo = pid_s * SB_PER_SPLIT
    sb_hi = tl.minimum(sb_lo + SB_PER_SPLIT, n_sb)
    for sb in range(sb_lo, sb_hi):
        gg = sb * 8 + g
        w = tl.load(q_ptr + ((nb * N_GROUPS + gg) * 4 + t) * 4 + r, mask=nb_ok, other=0,
                    eviction_policy="evict_first")  # [NB, R, G, T, 1]
        gr = (nb * N_GROUPS + gg) * 4 + r  # per-(group, row) planes: [NB, R, G, 1, 1]
        sc = tl.load(sc_ptr + gr, mask=nb_ok, other=0).to(tl.int32)
        lo, hi = _weights_f16(w, pp * 4, sc, ASM)  # [NB, R, G, T, PP] each
        wt = tl.reshape(tl.join(lo, hi), [ROWS, 256])
        xs = x_ptr + (m0 + m[None, :]).to(tl.int64) * stride_xm + sb * 256
        xk = tl.load(xs + xe[:, None], mask=m_ok[None, :], other=0.0, eviction_policy="evict_last").to(tl.float16)
        part = tl.dot(wt, xk, out_dtype=tl.float32)  # [ROWS, MMA_N], exact products
        sbr = tl.reshape((nb * n_sb + sb) * 4 + r, [ROWS])  # per-(superblock, row) planes
        d = tl.load(d_ptr + sbr, mask=ok, other=0.0).to(tl.float32)
        dmin = tl.load(dmin_ptr + sbr, mask=ok, other=0.0).to(tl.float32)
        y += d[:, None] * part
        # Mins: dmin * sum over the 8 groups of mn_g * (the group's activations' sum), on
        # tensor cores too: the group sums from exact products, then mn < 64 (exact in f16)
        # times the sums cut into three exact f16 pieces (attend_split_mma.dot3) after a
        # power-of-two scale per activation row.
        x_sum = tl.trans(tl.dot(in_group, xk, out_dtype=tl.float32))  # [MMA_N, 16 groups]
        # A power of two per activation row from the largest sum's exponent bits: the sums
        # times 2^(126 - eb) are below 1 (dot3 asks |x| < 2), and both scalings are exact.
        eb = tl.minimum((tl.max(tl.abs(x_sum), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF, 252)
        down = ((253 - eb) << 23).to(tl.float32, bitcast=True)
        up = ((eb + 1) << 23).to(tl.float32, bitcast=True)
        mn_at = tl.reshape(nb * N_GROUPS + sb * 8 + tl.arange(0, 16)[None, None, :, None, None], [BLOCK_NB, 1, 16])
        mn_at = mn_at * 4 + tl.reshape(r, [1, 4, 1])
        mn_ok = tl.reshape(nb_ok, [BLOCK_NB, 1, 1]) & (tl.arange(0, 16)[None, None, :] < 8)
        mn = tl.reshape(tl.load(mn_ptr + mn_at, mask=mn_ok, other=0).to(tl.float16), [ROWS, 16])
        part_min = tl.trans(dot3(x_sum * down[:, None], tl.trans(mn))) * up[None, :]  # [ROWS, MMA_N]
        y_min += dmin[:, None] * part_min
    out = y - y_min
    ok2 = ok[:, None] & m_ok[None, :]
    at = (m0 + m[None, :]).to(tl.int64) * stride_om + flat[:, None]
    if IS_SPLIT:
        tl.store(out_ptr + pid_s.to(tl.int64) * stride_os + at, out, mask=ok2)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + flat, mask=ok, other=0.0)[:, None]
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=ok2)


def mma_gemv_applies(x: torch.Tensor, w: RepackedWeight) -> bool:
    """Whether `repacked_gemv` takes this kernel: asked for (MINIVLLM_GEMV_KERNEL=mma), a
    Q4_K weight, f16 activations (exact in the dot; float32 stays float32), a profile with
    `tl.dot` (never the T4 profile)."""
    if os.environ.get(GEMV_KERNEL_ENV) != "mma" or w.ggml_type.name != "Q4_K" or x.dtype != torch.float16:
        return False
    if x.device.type == "cpu":
        return triton_interpreting()
    from minivllm.kernels.gpu_profile import gpu_profile

    return gpu_profile(x.device).tensor_core_dot


def mma_launch(n: int, k: int, sm_count: int) -> tuple[int, int]:
    """(row groups a program, K slices) for an (n, k) weight: 4 row groups (tl.dot's 16
    rows), and K split into whole superblocks until there are two programs an SM. A
    function of the shape only (batch-invariant). Not swept yet: a first guess."""
    programs = triton.cdiv(triton.cdiv(n, R), 4)
    split = min(k // 256, max(1, triton.cdiv(2 * sm_count, programs)))
    return 4, split


def mma_gemv(x: torch.Tensor, w: RepackedWeight, *, block_nb: int = 4, split: int = 1, num_warps: int = 4,
             out_dtype: torch.dtype | None = None, bias: torch.Tensor | None = None,
             defer_split_sum: bool = False) -> torch.Tensor | SplitPartials:
    """y = x @ W.T (+ bias) for a Q4_K weight and f16 x (M, K), float32 sums rounded once to
    `out_dtype` (default float32); `split` K slices of whole superblocks summed in slice
    order (`split_sum.py`), or handed back unsummed with `defer_split_sum`."""
    from minivllm.kernels.triton.tiled_gemv import gemv_inputs, split_output

    n, k = w.shape
    if w.ggml_type.name != "Q4_K" or x.dtype != torch.float16:
        raise ValueError(f"mma_gemv: Q4_K weights and f16 activations only, got {w.ggml_type.name} and {x.dtype}")
    x, out_dtype, empty = gemv_inputs(x, n, out_dtype)
    if empty is not None:
        return empty
    m = x.shape[0]
    n_sb = k // 256
    sb_per = triton.cdiv(n_sb, max(1, min(split, n_sb)))
    split = triton.cdiv(n_sb, sb_per)
    dest = (torch.empty((m, n), dtype=out_dtype, device=x.device) if split == 1
            else torch.empty((split, m, n), dtype=torch.float32, device=x.device))
    has_bias = bias is not None and split == 1
    grid = (triton.cdiv(triton.cdiv(n, R), block_nb), split, triton.cdiv(m, MMA_N.value))
    _mma_gemv_q4k_kernel[grid](
        x, w.qs, w.planes["d"], w.planes["dmin"], w.planes["sc"], w.planes["mn"], bias if has_bias else dest, dest,
        m, n, x.stride(0), dest.stride(-2), m * n, sb_per, N_GROUPS=k // 32, BLOCK_NB=block_nb,
        IS_SPLIT=split > 1, HAS_BIAS=has_bias,
        ASM=not triton_interpreting(), num_warps=num_warps, **pdl_args(x.device))
    return dest if split == 1 else split_output(dest, out_dtype, bias, defer_split_sum=defer_split_sum)
