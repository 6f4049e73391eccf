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

from dataclasses import dataclass

from minivllm.errors import ConfigError, UnsupportedArchitectureError
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

        def key(k: str) -> str:
            return f"{arch}.{k}"

        d_model = int(gf.require(key("embedding_length")))
        n_heads = int(gf.require(key("attention.head_count")))
        n_kv_heads = int(gf.get(key("attention.head_count_kv"), n_heads))
        head_dim = int(gf.get(key("attention.key_length"), d_model // n_heads))
        scaling_type = str(gf.get(key("rope.scaling.type"), "none"))
        if scaling_type not in ("none", "linear"):
            raise ConfigError(
                "rope.scaling.type", scaling_type,
                "minivllm supports RoPE scaling 'none' and 'linear' (Llama 3 rope_freqs is "
                "supported separately); use a model without YaRN scaling",
            )
        factor = float(gf.get(key("rope.scaling.factor"), 1.0)) if scaling_type == "linear" else 1.0
        embd = gf.tensor_info("token_embd.weight")
        return cls(
            architecture=arch,
            n_layers=int(gf.require(key("block_count"))),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            d_ff=int(gf.require(key("feed_forward_length"))),
            vocab_size=embd.shape[0],
            rms_eps=float(gf.require(key("attention.layer_norm_rms_epsilon"))),
            rope_base=float(gf.get(key("rope.freq_base"), 10000.0)),
            rope_dim=int(gf.get(key("rope.dimension_count"), head_dim)),
            rope_style="adjacent" if arch == "llama" else "halves",
            rope_linear_factor=factor,
            context_length=int(gf.get(key("context_length"), 4096)),
            qkv_bias=arch == "qwen2",
            tied_embeddings="output.weight" not in gf.tensors,
            has_rope_freqs="rope_freqs.weight" in gf.tensors,
            name=str(gf.get("general.name", gf.path.stem)),
        )

    def describe(self) -> dict:
        """A JSON-friendly view for snapshots and the notebook."""
        return dict(self.__dict__)
