"""Fused elementwise steps of a decoder layer, one Triton launch each.

A decode step on CUDA was ~50 small torch kernels per layer (RMSNorm alone is six:
pow, mean, add, rsqrt, mul, mul; RoPE another eight per tensor), each a few
microseconds even inside a CUDA graph; on Qwen2.5-0.5B that was most of the step. Here:

* `add_rms_norm`: h + delta (the residual add, float32) and RMSNorm of the sum, written
  in the matmul dtype, in one pass over the row; delta may be a split-K GEMV's unsummed
  partials, summed here by the GEMV's own rule (`split_sum.py`), one launch fewer;
* `rope_qk`: RoPE on a row's query and key heads (both GGUF layouts), queries out in
  float32, keys in their own dtype (the cache's); given the step's page slots, it also
  writes the keys and values into the KV cache (no separate store launch);
  `rope_qk_partials` takes a fused QKV GEMV's unsummed split-K partials instead and sums
  them by the GEMV's own rule as it reads them, one launch fewer a layer;
* `swiglu`: silu(gate) * up in float32, rounded once to the matmul dtype.

Same formulas and operation order as the torch references (`kernels/rmsnorm.py`,
`kernels/rope.py`, the decoder's SwiGLU); every row is computed by its own program, so
a row's result never depends on the batch (batch-invariant mode). float32 arithmetic
only, no `tl.dot`: compiles for sm_75 (T4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.triton.kv_store import store_row_heads
from minivllm.kernels.triton.paged_attention import require_triton_device
from minivllm.kernels.triton.pdl import pdl_args, wait_for_producers
from minivllm.kernels.triton.split_sum import SplitPartials, round_to, slice_sum

_MAX_BLOCK = 1 << 15
# Query heads a RoPE program takes from split-K partials (`rope_qk_partials`): a 7B row's
# 28 heads over 7 programs. With all of them in one program, that program read the 4 slices
# of 3,584 float32 alone, and the fold lost to the separate sum launch (h100-s58).
_PARTIAL_Q_HEADS = 4


@triton.jit
def _add_rms_norm_kernel(h_ptr, y_ptr, w_ptr, h_out_ptr, x_out_ptr, bias_ptr, stride_h, stride_y, stride_ys,
                         stride_ho, stride_xo, n_cols, eps, HAS_Y: tl.constexpr, SPLIT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y: the delta (SPLIT = 1, any float dtype), or a split GEMV's float32 partials
    (SPLIT slices `stride_ys` apart), summed and rounded as the GEMV's own split sum would
    have (`split_sum.py`) before the residual add."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_Y:
        y = slice_sum(y_ptr, row * stride_y + cols, mask, stride_ys, bias_ptr, cols, SPLIT, HAS_BIAS)
        h = h + round_to(y, ROUND)
        tl.store(h_out_ptr + row * stride_ho + cols, h, mask=mask)
    variance = tl.sum(h * h, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    x = h * tl.rsqrt(variance + eps) * w  # the reference's order: (h * rsqrt(var + eps)) * w
    tl.store(x_out_ptr + row * stride_xo + cols, x.to(x_out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | SplitPartials | None, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta) in out_dtype). h: (T, d) float32 residual stream;
    delta: (T, d) any float dtype; or a split GEMV's `SplitPartials` (from
    `QuantLinear.partials`), summed here exactly as the GEMV's split sum would have
    (slice order, bias, one rounding to its out dtype), so the same bits as passing that
    GEMV's output; or None (norm only; h is returned as is)."""
    t, d = h.shape
    block = triton.next_power_of_2(d)
    partials = delta if isinstance(delta, SplitPartials) else None
    y = partials.ws if partials is not None else delta
    if y is not None and tuple(y.shape[-2:]) != (t, d):
        raise ValueError(f"add_rms_norm: delta of shape {tuple(y.shape[-2:])} for h of shape {(t, d)}")
    if block > _MAX_BLOCK or h.stride(-1) != 1 or (y is not None and y.stride(-1) != 1):
        raise ValueError("add_rms_norm: rows must be contiguous and at most 32768 wide")
    require_triton_device({"h": h, "weight": weight}, "add_rms_norm")
    h_out = torch.empty_like(h) if delta is not None else h
    x = torch.empty((t, d), dtype=out_dtype, device=h.device)
    if t:
        y = y if y is not None else h
        bias = partials.bias if partials is not None else None
        _add_rms_norm_kernel[(t,)](h, y, weight, h_out, x, bias if bias is not None else h, h.stride(0),
                                   y.stride(-2), y.stride(0) if partials is not None else 0, h_out.stride(0),
                                   x.stride(0), d, float(eps), HAS_Y=delta is not None,
                                   SPLIT=partials.split if partials is not None else 1, HAS_BIAS=bias is not None,
                                   ROUND=partials.round_code if partials is not None else 0, BLOCK=block,
                                   num_warps=4 if block <= 4096 else 8, **pdl_args(h.device))
    return h_out, x


@triton.jit
def _rope_heads(x_ptr, o_ptr, cos_ptr, sin_ptr, row, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
                N_HEADS: tl.constexpr, HALF: tl.constexpr, ADJACENT: tl.constexpr, BLOCK_H: tl.constexpr,
                cache_ptr, slot, stride_cs, stride_ch, STORE: tl.constexpr, stride_ws, bias_ptr,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr, h0=0):
    """Heads h0 .. h0 + BLOCK_H - 1 (those below N_HEADS). x: the heads' values (SPLIT = 1),
    or a split GEMV's partials (SPLIT slices `stride_ws` apart, bias per head at bias_ptr),
    summed as its own split sum would."""
    heads = h0 + tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, HALF)[None, :]
    mask = heads < N_HEADS
    if ADJACENT:  # pairs (x[2j], x[2j+1])
        ia = 2 * j
        ib = 2 * j + 1
    else:  # pairs (x[j], x[j + d/2])
        ia = j
        ib = j + HALF
    xr = row * stride_xt + heads * stride_xh
    a = round_to(slice_sum(x_ptr, xr + ia, mask, stride_ws, bias_ptr, heads * 2 * HALF + ia, SPLIT, HAS_BIAS), ROUND)
    b = round_to(slice_sum(x_ptr, xr + ib, mask, stride_ws, bias_ptr, heads * 2 * HALF + ib, SPLIT, HAS_BIAS), ROUND)
    cos = tl.load(cos_ptr + row * stride_c + j)
    sin = tl.load(sin_ptr + row * stride_c + j)
    orow = o_ptr + row * stride_ot + heads * stride_oh
    ty = o_ptr.dtype.element_ty
    ra = (a * cos - b * sin).to(ty)
    rb = (a * sin + b * cos).to(ty)
    tl.store(orow + ia, ra, mask=mask)
    tl.store(orow + ib, rb, mask=mask)
    if STORE:  # the keys' page slot too, rounded from k's dtype to the cache's as attend would
        store_row_heads(cache_ptr, slot, stride_cs, stride_ch, heads, ia, ra, mask)
        store_row_heads(cache_ptr, slot, stride_cs, stride_ch, heads, ib, rb, mask)


@triton.jit
def _rope_qk_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_c,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    stride_vt,
    stride_vh,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    ADJACENT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    STORE: tl.constexpr,
    stride_ws=0,
    qb_ptr=None,
    kb_ptr=None,
    stride_wsv=0,
    vb_ptr=None,
    SPLIT: tl.constexpr = 1,
    HAS_BIAS: tl.constexpr = False,
    ROUND: tl.constexpr = 0,
    SPLIT_V: tl.constexpr = 1,
    HAS_BIAS_V: tl.constexpr = False,
    ROUND_V: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Programs (row, i): query heads i*BLOCK_H .. for i below the last, the keys (and
    values) for the last. SPLIT > 1: q and k point into slice 0 of a split GEMV's partials
    (slices `stride_ws` apart, their biases at qb/kb_ptr, ROUND its out dtype); SPLIT_V > 1:
    v into another's, or the same one's (stride_wsv, vb_ptr, ROUND_V)."""
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) < tl.num_programs(1) - 1:
        _rope_heads(q_ptr, qo_ptr, cos_ptr, sin_ptr, row, stride_qt, stride_qh, stride_qot, stride_qoh, stride_c,
                    H, HALF, ADJACENT, BLOCK_H, qo_ptr, row, 0, 0, False, stride_ws, qb_ptr, SPLIT, HAS_BIAS, ROUND,
                    tl.program_id(1) * BLOCK_H)
    else:
        slot = tl.load(slots_ptr + row).to(tl.int64) if STORE else row
        _rope_heads(k_ptr, ko_ptr, cos_ptr, sin_ptr, row, stride_kt, stride_kh, stride_kot, stride_koh, stride_c,
                    KVH, HALF, ADJACENT, BLOCK_KVH, kc_ptr, slot, stride_kcs, stride_kch, STORE, stride_ws, kb_ptr,
                    SPLIT, HAS_BIAS, ROUND)
        if STORE:  # and the values, unchanged but for the cache dtype
            heads = tl.arange(0, BLOCK_KVH)[:, None]
            dims = tl.arange(0, 2 * HALF)[None, :]
            mask = heads < KVH
            v = round_to(slice_sum(v_ptr, row * stride_vt + heads * stride_vh + dims, mask, stride_wsv, vb_ptr,
                                   heads * 2 * HALF + dims, SPLIT_V, HAS_BIAS_V), ROUND_V)
            store_row_heads(vc_ptr, slot, stride_vcs, stride_vch, heads, dims, v, mask)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str,
            q_dtype: torch.dtype = torch.float32, store: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE over every dimension of q (T, H, D) and k (T, KVH, D) (last dim contiguous);
    cos/sin (T, D/2) float32. Returns q in `q_dtype` and k in k's dtype.

    store: (k_cache, v_cache, slots, v), from `PagedBatchKV.store_target` and this
    step's values v (T, KVH, D): the same launch also writes the rotated keys and v into
    their page slots, the values `attend` would write (then call `attend_stored`)."""
    return _rope(q, k, cos, sin, style, q_dtype, store, k.dtype, {})


def rope_qk_partials(qk: SplitPartials | torch.Tensor, v: SplitPartials | torch.Tensor, n_heads: int,
                     n_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor, style: str, store: tuple,
                     q_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`rope_qk` with `store`, reading q and k from the output of a GEMV whose columns are
    q | k (| v), and v from another GEMV's output (or from that one's columns after q | k,
    when `v is qk`); either may be a split GEMV's unsummed partials (`QuantLinear.partials`),
    each value then summed by the GEMV's own rule (slice order, bias, one rounding to its out
    dtype) as it is read: the bits of rope_qk of the GEMVs' outputs, without the sums'
    launches. Returns the rotated queries; keys and values go to the cache (`store`:
    k_cache, v_cache, slots)."""
    t = (qk.ws.shape[1] if isinstance(qk, SplitPartials) else qk.shape[0])
    d = cos.shape[-1] * 2
    q_cols, k_cols = (0, n_heads * d), (n_heads * d, (n_heads + n_kv_heads) * d)
    v_cols = (k_cols[1], k_cols[1] + n_kv_heads * d) if v is qk else (0, n_kv_heads * d)
    (q, k), qk_args = _columns(qk, (q_cols, k_cols), t, d)
    (v,), v_args = _columns(v, (v_cols,), t, d)
    split = {"stride_ws": qk_args["stride"], "SPLIT": qk_args["split"], "ROUND": qk_args["round"],
             "stride_wsv": v_args["stride"], "SPLIT_V": v_args["split"], "ROUND_V": v_args["round"]}
    if qk_args["bias"] is not None:
        split.update(qb_ptr=qk_args["bias"][0], kb_ptr=qk_args["bias"][1], HAS_BIAS=True)
    if v_args["bias"] is not None:
        split.update(vb_ptr=v_args["bias"][0], HAS_BIAS_V=True)
    return _rope(q, k, cos, sin, style, q_dtype, (*store, v), qk_args["dtype"], split)[0]


def _columns(out: SplitPartials | torch.Tensor, cols, t: int, d: int):
    """Views (t, heads, d) of `out`'s column ranges (of slice 0 where it is partials) and
    its sum's kernel arguments: slice stride, split, rounding code, the ranges' biases (or
    None) and the dtype the GEMV returns."""
    if isinstance(out, SplitPartials):
        ws = out.ws
        if ws.shape[1] != t or ws.stride(-1) != 1 or ws.shape[2] < max(b for _, b in cols):
            raise ValueError(f"rope_qk_partials: partials of shape {tuple(ws.shape)} for {t} rows, columns {cols}")
        bias = None if out.bias is None else [out.bias[a:b] for a, b in cols]
        return ([ws[0, :, a:b].view(t, -1, d) for a, b in cols],
                {"stride": ws.stride(0), "split": out.split, "round": out.round_code, "bias": bias,
                 "dtype": out.out_dtype})
    if out.shape[0] != t or out.stride(-1) != 1 or out.shape[1] < max(b for _, b in cols):
        raise ValueError(f"rope_qk_partials: output of shape {tuple(out.shape)} for {t} rows, columns {cols}")
    return ([out[:, a:b].view(t, -1, d) for a, b in cols],
            {"stride": 0, "split": 1, "round": 0, "bias": None, "dtype": out.dtype})


def _rope(q, k, cos, sin, style, q_dtype, store, k_dtype, split: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_qk's launch; `split`: the partials' kernel arguments (none: q, k, v are values)."""
    t, h, d = q.shape
    kvh = k.shape[1]
    half = d // 2
    if d % 2 or half & (half - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or cos.shape != (t, half):
        raise ValueError("rope_qk: full-width RoPE over a power-of-two half dimension, contiguous last dims")
    require_triton_device({"q": q, "k": k, "cos": cos}, "rope_qk")
    cos, sin = cos.contiguous(), sin.contiguous()
    qo = torch.empty((t, h, d), dtype=q_dtype, device=q.device)
    ko = torch.empty((t, kvh, d), dtype=k_dtype, device=k.device)
    if store is not None:
        k_cache, v_cache, slots, v = store
        if v.shape != k.shape or v.stride(-1) != 1 or k_cache.shape[1:] != k.shape[1:] or slots.shape != (t,):
            raise ValueError("rope_qk store: v like k, caches (slots, KVH, D), one slot per row, contiguous last dims")
        cache_args = (v, k_cache, v_cache, slots, v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
                      v_cache.stride(0), v_cache.stride(1))
    else:
        cache_args = (k, ko, ko, q, 0, 0, 0, 0, 0, 0)  # placeholders, never touched (STORE=False)
    # values, not partials: the bias pointers are placeholders, never read (HAS_BIAS off)
    no_split = {"stride_ws": 0, "qb_ptr": q, "kb_ptr": q, "stride_wsv": 0, "vb_ptr": q}
    # Query heads a program: all of a row's for values (two programs a row), _PARTIAL_Q_HEADS
    # for partials, whose SPLIT slices a program would otherwise read alone.
    block_h = triton.next_power_of_2(h) if not split else min(triton.next_power_of_2(h), _PARTIAL_Q_HEADS)
    if t:
        _rope_qk_kernel[(t, triton.cdiv(h, block_h) + 1)](
                                q, k, qo, ko, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos.stride(0), *cache_args,
                                H=h, KVH=kvh, HALF=half, ADJACENT=style == "adjacent",
                                BLOCK_H=block_h, BLOCK_KVH=triton.next_power_of_2(kvh),
                                STORE=store is not None, **{**no_split, **split}, **pdl_args(q.device))
    return qo, ko


@triton.jit
def silu_mul(g, u):
    """silu(g) * u for float32 g, u: the one home of the formula and its operation order
    (this file's SwiGLU kernel and the gate+up GEMV's epilogue, `tiled_gemv.py`)."""
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait_for_producers(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(g, u)  # in float32
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def swiglu(g: torch.Tensor, u: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """silu(g) * u computed in float32, returned in out_dtype. g, u: (T, d_ff)."""
    t, n = g.shape
    if g.stride(-1) != 1 or u.stride(-1) != 1 or u.shape != g.shape:
        raise ValueError("swiglu: two (T, d_ff) inputs with contiguous rows")
    require_triton_device({"g": g, "u": u}, "swiglu")
    out = torch.empty((t, n), dtype=out_dtype, device=g.device)
    block = 1024
    if t:
        _swiglu_kernel[(t, triton.cdiv(n, block))](g, u, out, n, g.stride(0), u.stride(0), out.stride(0), BLOCK=block,
                                                   **pdl_args(g.device))
    return out
