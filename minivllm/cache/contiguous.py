"""One request's keys and values in one preallocated tensor per layer.

The simplest correct cache, used by `DecoderModel.forward` for a single sequence and
as the reference the engine's page pool is tested against.
Preallocating to `max_len` avoids a concatenation per step (which made the
original engine's decode quadratic in copies).
"""

from __future__ import annotations

import torch

from minivllm.errors import ConfigError
from minivllm.kernels.attention import causal_attention


class ContiguousKVCache:
    def __init__(self, n_layers: int, max_len: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (n_layers, max_len, n_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0  # tokens whose K/V are stored (committed after the last layer)

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v (T, KVH, D) at positions start.. and return the keys/values 0..start+T."""
        end = start + k.shape[0]
        if end > self.max_len:
            raise ConfigError(
                "max_model_len", self.max_len,
                f"the sequence needs {end} positions; raise max_model_len or shorten the prompt/max_tokens",
            )
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v
        return self.k[layer, :end], self.v[layer, :end]

    def view(self, start: int, n: int) -> "_SequenceView":
        """The `attend` interface the model calls, for tokens start..start+n-1."""
        return _SequenceView(self, start)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class _SequenceView:
    def __init__(self, cache: ContiguousKVCache, start: int):
        self.cache = cache
        self.start = start

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = self.cache.append(layer, self.start, k, v)
        return causal_attention(q, keys, values, self.start)
