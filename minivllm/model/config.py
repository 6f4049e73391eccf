"""Model hyper-parameters read from GGUF metadata, validated once.

Both supported architectures are the same decoder (RMSNorm, RoPE, GQA attention,
SwiGLU MLP); they differ in three facts that this config records explicitly:

* `llama` files store Q/K rows permuted by the converter so that RoPE rotates
  *adjacent* pairs (x0,x1),(x2,x3)…; `qwen2` files keep HF's layout, which rotates
  the two *halves* of each head (rotate-half, "NeoX" style).
* `qwen2` has biases on Q, K and V.
* Llama 3.x ships per-frequency RoPE scaling factors as a `rope_freqs` tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from minivllm.errors import ConfigError, GGUFFormatError, InvalidMetadataError, UnsupportedArchitectureError
from minivllm.gguf.reader import GGUFFile

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_style: str  # "adjacent" (llama) or "halves" (qwen2)
    rope_linear_factor: float  # positions are divided by this (rope.scaling.type == linear)
    context_length: int
    qkv_bias: bool
    tied_embeddings: bool
    has_rope_freqs: bool
    name: str = ""

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "ModelConfig":
        arch = gf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(arch, list(SUPPORTED_ARCHITECTURES))
        where = str(gf.path)

        def key(k: str) -> str:
            return f"{arch}.{k}"

        def positive_int(k: str, default: int | None = None) -> int:
            """An integer hyper-parameter >= 1 (type and range named in the error)."""
            value = gf.require_as(key(k), "int") if default is None else gf.get_as(key(k), "int", default)
            if value < 1:
                raise InvalidMetadataError(key(k), where, f"is {value}, expected a positive integer")
            return int(value)

        def positive_float(k: str, default: float | None = None) -> float:
            value = gf.require_as(key(k), "float") if default is None else gf.get_as(key(k), "float", default)
            if not (math.isfinite(value) and value > 0):
                raise InvalidMetadataError(key(k), where, f"is {value}, expected a positive finite number")
            return float(value)

        d_model = positive_int("embedding_length")
        n_heads = positive_int("attention.head_count")
        n_kv_heads = positive_int("attention.head_count_kv", n_heads)
        if n_heads % n_kv_heads:
            raise InvalidMetadataError(
                key("attention.head_count_kv"), where,
                f"is {n_kv_heads}, expected a divisor of {key('attention.head_count')}={n_heads}",
            )
        if key("attention.key_length") not in gf.metadata and d_model < n_heads:
            raise InvalidMetadataError(
                key("embedding_length"), where,
                f"is {d_model}, expected at least {key('attention.head_count')}={n_heads} (one element per head)",
            )
        head_dim = positive_int("attention.key_length", d_model // n_heads)
        rope_dim = positive_int("rope.dimension_count", head_dim)
        if rope_dim % 2 or rope_dim > head_dim:
            raise InvalidMetadataError(
                key("rope.dimension_count"), where, f"is {rope_dim}, expected an even number <= head_dim={head_dim}"
            )
        scaling_type = gf.get_as(key("rope.scaling.type"), "str", "none")
        if scaling_type not in ("none", "linear"):
            raise ConfigError(
                "rope.scaling.type", scaling_type,
                "minivllm supports RoPE scaling 'none' and 'linear' (Llama 3 rope_freqs is "
                "supported separately); use a model without YaRN scaling",
            )
        factor = positive_float("rope.scaling.factor", 1.0) if scaling_type == "linear" else 1.0
        embd = gf.tensor_info("token_embd.weight")
        if len(embd.shape) != 2 or min(embd.shape) < 1:
            raise GGUFFormatError(
                f"{where}: tensor 'token_embd.weight' has shape {embd.shape}, expected (vocab_size, "
                f"{key('embedding_length')}) with both >= 1; the file is corrupt: download or convert it again"
            )
        return cls(
            architecture=arch,
            n_layers=positive_int("block_count"),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            d_ff=positive_int("feed_forward_length"),
            vocab_size=embd.shape[0],
            rms_eps=positive_float("attention.layer_norm_rms_epsilon"),
            rope_base=positive_float("rope.freq_base", 10000.0),
            rope_dim=rope_dim,
            rope_style="adjacent" if arch == "llama" else "halves",
            rope_linear_factor=factor,
            context_length=positive_int("context_length", 4096),
            qkv_bias=arch == "qwen2",
            tied_embeddings="output.weight" not in gf.tensors,
            has_rope_freqs="rope_freqs.weight" in gf.tensors,
            name=str(gf.get("general.name", gf.path.stem)),
        )

    def describe(self) -> dict:
        """A JSON-friendly view for snapshots and the notebook."""
        return dict(self.__dict__)
