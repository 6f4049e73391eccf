"""Rotary position embeddings in the two layouts GGUF files use.

* "adjacent": llama.cpp's converter permutes Llama Q/K rows so that each rotated
  pair is (x[2i], x[2i+1]) — ggml's "normal" RoPE.
* "halves": Qwen2 keeps HF's layout, pairing x[i] with x[i + d/2] ("NeoX" RoPE).

Angles follow HF's float32 recipe (inv_freq = 1 / base^(2i/d), then pos * inv_freq)
so logits agree with transformers to ~1e-6. Llama 3's `rope_freqs` divides each
frequency by a stored factor; linear scaling divides positions by a factor.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(
        self,
        rope_dim: int,
        base: float,
        style: str,
        *,
        freq_factors: torch.Tensor | None = None,
        linear_factor: float = 1.0,
        device: torch.device | str = "cpu",
    ):
        if style not in ("adjacent", "halves"):
            raise ValueError(f"unknown RoPE style {style!r}; expected 'adjacent' or 'halves'")
        self.rope_dim = rope_dim
        self.style = style
        exponent = torch.arange(0, rope_dim, 2, dtype=torch.int64, device=device).float() / rope_dim
        inv_freq = 1.0 / (base ** exponent)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(device=device, dtype=torch.float32)
        self.inv_freq = inv_freq / linear_factor

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape (T, rope_dim // 2), float32."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rotate x of shape (T, heads, head_dim); computed in float32, returned in
        `out_dtype` (default: x's dtype)."""
        out_dtype = out_dtype or x.dtype
        if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3:
            from minivllm.kernels.cpu_gemv import rope_f32

            out = rope_f32(x, cos, sin, self.rope_dim, self.style == "adjacent")  # the same math compiled, or None
            if out is not None:
                return out if out_dtype == torch.float32 else out.to(out_dtype)
        rot, rest = x[..., : self.rope_dim].float(), x[..., self.rope_dim :]
        cos, sin = cos[:, None, :], sin[:, None, :]
        if self.style == "adjacent":
            a, b = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            half = self.rope_dim // 2
            a, b = rot[..., :half], rot[..., half:]
            out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        out = out.to(out_dtype)
        return out if rest.shape[-1] == 0 else torch.cat((out, rest.to(out_dtype)), dim=-1)
