"""The decoder shared by Llama and Qwen2: RMSNorm → attention → RMSNorm → SwiGLU MLP.

Numerics contract (DESIGN.md): the residual stream, RMSNorm statistics, RoPE angles
and softmax are float32; only matmul inputs/weights use the activation dtype. This is
what keeps f16 usable on T4-class GPUs.

The model does not own a KV cache. Each forward receives a `kv` object whose
`attend(layer, q, k, v)` stores the new keys/values wherever the cache keeps them
(one contiguous tensor, or pages of a shared pool) and returns the attention output,
so the cache layout can change without touching the model.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from minivllm.kernels.gpu_profile import runs_gpu_path
from minivllm.kernels.kernel_options import KernelOptions, kernel_options_for_call, options_in_effect
from minivllm.kernels.linear import QuantEmbedding, QuantLinear, project_many
from minivllm.kernels.rmsnorm import rms_norm
from minivllm.kernels.rope import RotaryEmbedding
from minivllm.model.config import ModelConfig
from minivllm.model.cpu_decode import run_layers
from minivllm.obs.trace import trace_scope


@dataclass
class DecoderLayer:
    attn_norm: torch.Tensor
    q: QuantLinear
    k: QuantLinear
    v: QuantLinear
    o: QuantLinear
    ffn_norm: torch.Tensor
    gate: QuantLinear
    up: QuantLinear
    down: QuantLinear


class DecoderModel:
    def __init__(self, config: ModelConfig, embedding: QuantEmbedding, layers: list[DecoderLayer],
                 output_norm: torch.Tensor, output: QuantLinear, rope: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device, kernel_options: KernelOptions):
        self.config = config
        self.embedding = embedding  # lookup → float32 rows
        self.layers = layers
        self.output_norm = output_norm
        self.output = output
        self.rope = rope
        self.dtype = dtype
        self.device = device
        # The defaults (the loader's), for forwards that name no options of their own;
        # never changed after loading: an engine passes its options per call.
        self.kernel_options = kernel_options

    @property
    def batch_invariant(self) -> bool:
        return options_in_effect(self.kernel_options).batch_invariant

    @contextmanager
    def using(self, options: KernelOptions):
        """Run the block's forwards (also `forward`, which names no options) under
        `options`, resolved for this device; nothing shared changes."""
        with kernel_options_for_call(options.resolved(self.device)):
            yield self

    def fuse_projections(self) -> int:
        """On the GPU path, give each layer's Q/K/V and gate/up one weight per run of the
        same type (`kernels/fused_projection.py`; the separate linears become views of
        it, so memory and `weight_bytes` stay the same). Returns the fused weights made."""
        from minivllm.kernels.fused_projection import fuse_projections

        made = 0
        for layer in self.layers:
            made += len(fuse_projections((layer.q, layer.k, layer.v), "attn_qkv"))
            made += len(fuse_projections((layer.gate, layer.up), "ffn_gate_up"))
        return made

    def dense_bytes(self) -> int:
        """Bytes that dequantized copies of every projection (and the LM head) would take
        in the compute dtype: what `dequant_cache` costs."""
        linears = {id(lin.weight): lin for lin in [self.output] + [getattr(layer, f) for layer in self.layers
                                                                   for f in ("q", "k", "v", "o", "gate", "up", "down")]}
        return sum(lin.weight.shape[0] * lin.weight.shape[1] * torch.empty((), dtype=lin.compute_dtype).element_size()
                   for lin in linears.values())

    def weight_bytes(self) -> int:
        """Device bytes held by the GGUF-block weights (the embedding counted once when tied)."""
        seen, total = set(), 0
        linears = [self.output] + [getattr(layer, f) for layer in self.layers
                                   for f in ("q", "k", "v", "o", "gate", "up", "down")]
        for w in [self.embedding.weight] + [lin.weight for lin in linears]:
            if id(w) not in seen:
                seen.add(id(w))
                total += w.nbytes
        return total

    def gemv_weight_bytes(self) -> int:
        """Bytes a batch-1 decode step's GEMVs read: every projection and the LM head once
        (the embedding only where the LM head is tied to it). What a step profile divides
        by its GEMV time (scripts/profile_decode_step.py)."""
        linears = [self.output] + [getattr(layer, f) for layer in self.layers
                                   for f in ("q", "k", "v", "o", "gate", "up", "down")]
        return sum({id(lin.weight): lin.weight.nbytes for lin in linears}.values())

    @torch.inference_mode()
    def forward_batch(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv,
        logits_rows: torch.Tensor | None = None,
        hidden_states: list | None = None,
        *,
        options: KernelOptions | None = None,
    ) -> torch.Tensor:
        """One forward over a flattened batch of rows from any number of requests, under
        `options` (resolved for this device; default: those in effect, else the model's).

        `token_ids` and `positions` have shape (T,). `kv.attend(layer, q, k, v)` stores the
        rows' keys/values and returns their attention output (see cache/batch_kv.py).
        Logits (float32) are computed only for `logits_rows` (all rows when None): a
        prefill chunk that is not the prompt's end needs none. When `hidden_states` is a
        list, the float32 residual stream (T, d_model) is appended after the embedding and
        after every layer (debug.compare uses it to show where two runs part).
        """
        with kernel_options_for_call(options or options_in_effect(self.kernel_options)):
            return self._forward_batch(token_ids, positions, kv, logits_rows, hidden_states)

    def _forward_batch(self, token_ids, positions, kv, logits_rows, hidden_states) -> torch.Tensor:
        cfg = self.config
        t = token_ids.shape[0]
        cos, sin = self.rope.cos_sin(positions)
        h = self.embedding(token_ids).float()  # residual stream: float32
        if hidden_states is not None:
            hidden_states.append(h.clone())
        elif self._fused_ok(h):
            out = self._forward_fused(h, cos, sin, kv, logits_rows)
            if out is not None:  # None: the kernels failed to compile here (warned); the torch steps below
                return out
        elif not h.is_cuda and os.environ.get("MINIVLLM_CPU_LAYER_PLAN") != "0":
            done = run_layers(self, h, cos, sin, kv)  # the same kernels without the Python between them
            if done is not None:
                if logits_rows is not None:
                    done = done[logits_rows]
                return self.output(self._norm(done, self.output_norm))
        for i, layer in enumerate(self.layers):
            with trace_scope("layer", i):
                with trace_scope("attn"):
                    x = self._norm(h, layer.attn_norm).to(self.dtype)
                    q, k, v = project_many((layer.q, layer.k, layer.v), x)  # one kernel call where possible
                    q = q.view(t, cfg.n_heads, cfg.head_dim)
                    k = k.view(t, cfg.n_kv_heads, cfg.head_dim)
                    v = v.view(t, cfg.n_kv_heads, cfg.head_dim)
                    # Queries stay float32 after RoPE (attention upcasts anyway); keys are
                    # rounded once, to the cache dtype, when they are stored.
                    q = self.rope.apply(q, cos, sin, out_dtype=torch.float32)
                    k = self.rope.apply(k, cos, sin)
                    attn = kv.attend(i, q, k, v).reshape(t, cfg.n_heads * cfg.head_dim)
                    h = h + layer.o(attn).float()
                with trace_scope("mlp"):
                    x = self._norm(h, layer.ffn_norm).to(self.dtype)
                    # SwiGLU in float32: the product of two rounded values is where bf16
                    # loses most (top-1 agreement with f32 went from 97% to >99% on SmolLM2).
                    g, u = project_many((layer.gate, layer.up), x)
                    gated = torch.nn.functional.silu(g.float()) * u.float()
                    h = h + layer.down(gated.to(self.dtype)).float()
            if hidden_states is not None:
                hidden_states.append(h.clone())
        if logits_rows is not None:
            h = h[logits_rows]
        return self.output(self._norm(h, self.output_norm))  # float32 LM head

    # -- CUDA: the same layer with fused Triton steps (kernels/triton/fused.py) -----------

    def _fused_ok(self, h: torch.Tensor) -> bool:
        """Fused residual+RMSNorm, RoPE and SwiGLU kernels on CUDA (full-width RoPE), unless
        Triton is missing or failed to compile them here (then the torch steps, warned once)."""
        if (not runs_gpu_path(h.device) or self.rope.rope_dim != self.config.head_dim
                or os.environ.get("MINIVLLM_FUSED") == "0"):
            return False
        if getattr(self, "_fused_state", None) is None:
            try:
                from minivllm.kernels.triton import fused  # noqa: F401
                self._fused_state = "untried"
            except ImportError:
                self._fused_state = "off"
        return self._fused_state != "off"

    def _forward_fused(self, h, cos, sin, kv, logits_rows):
        if self._fused_state == "ok":
            return self._fused_layers(h, cos, sin, kv, logits_rows)
        try:  # the first call compiles the kernels
            out = self._fused_layers(h, cos, sin, kv, logits_rows)
        except Exception as exc:  # a Triton compile failure on this GPU: rerun with torch steps
            import warnings

            self._fused_state = "off"
            warnings.warn(f"Triton kernels add_rms_norm/rope_qk/swiglu could not run on {h.device} "
                          f"({type(exc).__name__}: {str(exc)[:200]}); using the torch steps", RuntimeWarning,
                          stacklevel=2)
            return None
        self._fused_state = "ok"
        return out

    def _fused_layers(self, h, cos, sin, kv, logits_rows):
        """forward_batch's layers with three fused kernels per step: h + delta and its
        RMSNorm in one pass (the residual add of the previous sublayer folded into the
        next norm), RoPE on q and k in one launch, SwiGLU in one launch (or in the fused
        gate+up GEMV's epilogue); Q/K/V and gate/up one GEMV each where fused
        (`fuse_projections`). The o- and down-projections feed add_rms_norm their split-K
        partials where their GEMV splits K (and, opt-in, Q|K(|V) feed rope_qk theirs where
        it stores K and V): each sums them itself (the same bits, one launch fewer each;
        off under MINIVLLM_FOLD_SPLIT_SUM=0)."""
        from minivllm.kernels.fused_projection import (
            fold_qkv_sum_enabled,
            fold_split_sum_enabled,
            project_swiglu,
            qk_v_outputs,
        )
        from minivllm.kernels.triton.fused import add_rms_norm, rope_qk, rope_qk_partials

        cfg = self.config
        t = h.shape[0]
        eps = cfg.rms_eps
        # what the projections that feed add_rms_norm return: the plain output, or its partials
        into_norm = QuantLinear.partials if fold_split_sum_enabled() else QuantLinear.__call__
        fold_qkv = fold_qkv_sum_enabled()  # opt-in: the fused Q|K(|V)'s partials to RoPE
        pending = None  # the last sublayer's output (or its split-K partials), added to h by the next norm
        for i, layer in enumerate(self.layers):
            with trace_scope("layer", i):
                with trace_scope("attn"):
                    h, x = add_rms_norm(h, pending, layer.attn_norm, eps, self.dtype)
                    # where the pool allows, RoPE stores K and V too
                    target = kv.store_target(i) if hasattr(kv, "store_target") else None
                    outs = qk_v_outputs(layer.q, layer.k, layer.v, x) if fold_qkv and target is not None else None
                    if outs is not None:  # RoPE reads the GEMVs' split-K partials, summing them
                        q = rope_qk_partials(*outs, cfg.n_heads, cfg.n_kv_heads, cos, sin, self.rope.style, target)
                        attn = kv.attend_stored(i, q)
                    else:
                        q, k, v = project_many((layer.q, layer.k, layer.v), x)  # one launch where fused
                        q = q.view(t, cfg.n_heads, cfg.head_dim)
                        k = k.view(t, cfg.n_kv_heads, cfg.head_dim)
                        v = v.view(t, cfg.n_kv_heads, cfg.head_dim)
                        # q float32, k in its dtype
                        q, k = rope_qk(q, k, cos, sin, self.rope.style, store=None if target is None else (*target, v))
                        attn = kv.attend(i, q, k, v) if target is None else kv.attend_stored(i, q)
                    attn = attn.reshape(t, cfg.n_heads * cfg.head_dim)
                    h, x = add_rms_norm(h, into_norm(layer.o, attn), layer.ffn_norm, eps, self.dtype)
                with trace_scope("mlp"):
                    pending = into_norm(layer.down, project_swiglu(layer.gate, layer.up, x, self.dtype))
        _, x = add_rms_norm(h, pending, self.output_norm, eps, torch.float32)
        if logits_rows is not None:
            x = x[logits_rows]
        return self.output(x)  # float32 LM head

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if h.is_cuda and options_in_effect(self.kernel_options).batch_invariant:
            # torch's CUDA reduction may split a row differently for 1 row than for 8;
            # the Triton kernel reduces every row the same way.
            from minivllm.kernels.triton.rmsnorm import rms_norm_rows

            return rms_norm_rows(h, weight, self.config.rms_eps)
        return rms_norm(h, weight, self.config.rms_eps)

    def forward(self, token_ids: torch.Tensor, start_pos: int, cache, *, all_logits: bool = False,
                hidden_states: list | None = None) -> torch.Tensor:
        """One sequence at positions start_pos.. through a `ContiguousKVCache`.

        Returns float32 logits for the last token (shape (vocab,)) or, with
        `all_logits`, for every token (shape (T, vocab)).
        """
        t = token_ids.shape[0]
        positions = torch.arange(start_pos, start_pos + t, device=self.device)
        rows = None if all_logits else torch.tensor([t - 1], device=self.device)
        logits = self.forward_batch(token_ids, positions, cache.view(start_pos, t), rows, hidden_states)
        return logits if all_logits else logits[0]
