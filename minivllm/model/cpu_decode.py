"""The decoder's layers for CPU rows that take the GEMV path, with the Python between the
kernels cut to the calls themselves.

A decode step on SmolLM2 spent about as long between its compiled kernels as in them
(~4 ms of ~9 per token at two threads: dispatch in `QuantLinear`, `project_many`, the
norm and RoPE wrappers, and no-op dtype casts, for 30 layers x 7 projections). This path
runs the same kernels in the same order on the same inputs: the compiled RMSNorm, the
float32 or q8 GEMV of `cpu_gemv` on the layer's fused Q/K/V and gate/up, the compiled RoPE,
the KV object's attention, SwiGLU in float32. Every value is bit for bit what
`DecoderModel.forward_batch`'s general loop computes (tested), so it is a speed change only.

It applies when the model is float32 between the matmuls (`dtype=float32`, or the CPU
fast mode), every projection of every layer takes a compiled GEMV at this row count, the
kernels are loaded, batch-invariant mode is off and tracing is off (the trace wants its
per-layer ranges). Otherwise `run_layers` returns None and the general loop runs.
"""

from __future__ import annotations

import torch

from minivllm.kernels import cpu_gemv
from minivllm.kernels.kernel_options import options_in_effect
from minivllm.obs.trace import tracing_enabled


class CpuLayerPlan:
    """Per layer, the kernel calls with their arguments made once (one plan per set of
    the kernel options that choose them: engines over one model may differ in them)."""

    def __init__(self, model, key: tuple):
        self.key = key
        self.layers = []
        for layer in model.layers:
            self.layers.append(
                (
                    layer.attn_norm,
                    _projection_call((layer.q, layer.k, layer.v)),
                    (layer.q.bias, layer.k.bias, layer.v.bias),
                    _projection_call((layer.o,)),
                    layer.o.bias,
                    layer.ffn_norm,
                    _projection_call((layer.gate, layer.up)),
                    (layer.gate.bias, layer.up.bias),
                    _projection_call((layer.down,)),
                    layer.down.bias,
                )
            )
        # Every projection has a compiled GEMV at these options, or the plan never applies.
        self.ok = all(calls is not None for entry in self.layers for calls in (entry[1], entry[3], entry[6], entry[8]))


def _options_key(options) -> tuple:
    return (options.cpu_gemv, options.gemv_max_rows, options.batch_invariant)


def _projection_call(linears):
    """x -> [lin(x) for lin in linears] through one kernel call, or None if any of them
    would take another path."""
    modes = {lin.cpu_gemv_mode() if lin._cpu_quant else None for lin in linears}
    if len(modes) != 1 or next(iter(modes)) not in ("f32", "q8"):
        return None
    ext = cpu_gemv.extension()
    if next(iter(modes)) == "f32":
        raws, types, ns = cpu_gemv.prepare([lin.weight for lin in linears])
        return lambda x: ext.gemv(x, raws, types, ns)
    args = [lin.q8_args() for lin in linears]
    types, ns = [a[2] for a in args], [a[3] for a in args]
    if args[0][0] == "packed":
        qs, d, mins, qh = ([a[1][j] for a in args] for j in range(4))
        return lambda x: ext.gemv_q8_packed(x, types, qs, d, mins, qh, ns)
    blocks = [a[1] for a in args]
    return lambda x: ext.gemv_q8(x, blocks, types, ns)


def _plan(model) -> CpuLayerPlan | None:
    plans = model.__dict__.setdefault("_cpu_layer_plans", {})
    key = _options_key(options_in_effect(model.kernel_options))
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = CpuLayerPlan(model, key)
    return plan if plan.ok else None


def run_layers(model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv) -> torch.Tensor | None:
    """h after every layer, or None where this path does not apply (see the module docstring)."""
    opts = options_in_effect(model.kernel_options)
    rows = h.shape[0]
    if (h.device.type != "cpu" or model.dtype != torch.float32 or opts.batch_invariant or tracing_enabled()
            or not 0 < rows <= (opts.gemv_max_rows or 0) or cpu_gemv.extension() is None):
        return None
    plan = _plan(model)
    if plan is None:
        return None
    ext = cpu_gemv.extension()
    cfg = model.config
    eps, rope = cfg.rms_eps, model.rope
    adjacent = rope.style == "adjacent"
    qshape, kvshape = (rows, cfg.n_heads, cfg.head_dim), (rows, cfg.n_kv_heads, cfg.head_dim)
    opts.path_counts["gemv"] += 7 * len(plan.layers)
    for i, (attn_norm, qkv, qkv_bias, o, o_bias, ffn_norm, gate_up, gu_bias, down, down_bias) in enumerate(plan.layers):
        x = ext.rms_norm_f32(h, attn_norm, eps)
        q, k, v = qkv(x)
        for y, b in zip((q, k, v), qkv_bias):
            if b is not None:
                y.add_(b)
        q = ext.rope_f32(q.view(qshape), cos, sin, rope.rope_dim, adjacent)
        k = ext.rope_f32(k.view(kvshape), cos, sin, rope.rope_dim, adjacent)
        attn = kv.attend(i, q, k, v.view(kvshape)).reshape(rows, -1)
        y = o(attn if attn.is_contiguous() else attn.contiguous())[0]
        h = h + (y.add_(o_bias) if o_bias is not None else y)
        x = ext.rms_norm_f32(h, ffn_norm, eps)
        g, u = gate_up(x)
        if gu_bias[0] is not None:
            g.add_(gu_bias[0])
        if gu_bias[1] is not None:
            u.add_(gu_bias[1])
        y = down(torch.nn.functional.silu(g) * u)[0]
        h = h + (y.add_(down_bias) if down_bias is not None else y)
    return h
