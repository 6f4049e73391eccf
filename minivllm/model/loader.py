"""Build a `DecoderModel` from a GGUF file: tensor names, shapes, dequantization.

Weights are copied to the target device as raw GGUF bytes and dequantized there,
so a GPU load moves file-sized data over PCIe, not float32-sized data.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from minivllm.errors import GGUFFormatError
from minivllm.gguf.dequant import dequantize
from minivllm.gguf.reader import GGUFFile
from minivllm.kernels.linear import DenseLinear
from minivllm.kernels.rope import RotaryEmbedding
from minivllm.model.config import ModelConfig
from minivllm.model.decoder import DecoderLayer, DecoderModel


class _TensorLoader:
    def __init__(self, gf: GGUFFile, device: torch.device, progress: tqdm | None):
        self.gf = gf
        self.device = device
        self.progress = progress

    def get(self, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        info = self.gf.tensor_info(name)  # MissingTensorError names the tensor
        if shape is not None and tuple(info.shape) != tuple(shape):
            raise GGUFFormatError(
                f"{self.gf.path}: tensor {name!r} has shape {info.shape}, expected {shape} "
                f"from the file's own hyper-parameters; the file is inconsistent"
            )
        raw = self.gf.tensor_bytes(name).to(self.device)
        out = dequantize(raw, info.ggml_type, info.shape, dtype=dtype, tensor_name=name)
        if self.progress is not None:
            self.progress.update(info.nbytes)
        return out

    def maybe(self, name: str, dtype: torch.dtype) -> torch.Tensor | None:
        return self.get(name, dtype) if name in self.gf.tensors else None


def load_model(gf: GGUFFile, device: torch.device, dtype: torch.dtype, *, progress: bool = True) -> DecoderModel:
    cfg = ModelConfig.from_gguf(gf)
    total = sum(t.nbytes for t in gf.tensors.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {gf.path.name}", disable=not progress)
    ld = _TensorLoader(gf, device, bar)
    f32 = torch.float32
    q_out = cfg.n_heads * cfg.head_dim
    kv_out = cfg.n_kv_heads * cfg.head_dim

    def linear(prefix: str, out_f: int, in_f: int) -> DenseLinear:
        w = ld.get(f"{prefix}.weight", dtype, (out_f, in_f))
        b = ld.maybe(f"{prefix}.bias", f32)
        return DenseLinear(w, b, name=prefix.rsplit(".", 1)[-1])

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}"
        layers.append(DecoderLayer(
            attn_norm=ld.get(f"{p}.attn_norm.weight", f32, (cfg.d_model,)),
            q=linear(f"{p}.attn_q", q_out, cfg.d_model),
            k=linear(f"{p}.attn_k", kv_out, cfg.d_model),
            v=linear(f"{p}.attn_v", kv_out, cfg.d_model),
            o=linear(f"{p}.attn_output", cfg.d_model, q_out),
            ffn_norm=ld.get(f"{p}.ffn_norm.weight", f32, (cfg.d_model,)),
            gate=linear(f"{p}.ffn_gate", cfg.d_ff, cfg.d_model),
            up=linear(f"{p}.ffn_up", cfg.d_ff, cfg.d_model),
            down=linear(f"{p}.ffn_down", cfg.d_model, cfg.d_ff),
        ))
    # The LM head runs in float32 whatever the activation dtype: logits decide which
    # token is sampled, and bf16 logits (8-bit mantissa, ±0.06 at a logit of 15) flip
    # near-ties often enough to drop greedy agreement with f32 below 99%. The
    # embedding table shares that f32 matrix when tied (the lookup is f32 anyway).
    if cfg.tied_embeddings:
        embedding = ld.get("token_embd.weight", f32, (cfg.vocab_size, cfg.d_model))
        output = DenseLinear(embedding, name="output")
    else:
        embedding = ld.get("token_embd.weight", dtype, (cfg.vocab_size, cfg.d_model))
        output = DenseLinear(ld.get("output.weight", f32, (cfg.vocab_size, cfg.d_model)), name="output")
    freq_factors = ld.get("rope_freqs.weight", f32) if cfg.has_rope_freqs else None
    rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_base, cfg.rope_style, freq_factors=freq_factors,
                           linear_factor=cfg.rope_linear_factor, device=device)
    model = DecoderModel(cfg, embedding, layers, ld.get("output_norm.weight", f32, (cfg.d_model,)),
                         output, rope, dtype, device)
    bar.close()
    return model
