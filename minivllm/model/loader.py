"""Build a `DecoderModel` from a GGUF file: tensor names, shapes, kernels.

Projection and embedding weights stay in their GGUF block format on the device
(`QuantizedWeight`), so a model's memory is about its file size; a GPU load moves
file-sized data over PCIe. Norm weights, biases and RoPE factors (small, F32 in
every real file) are dequantized to float32.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from minivllm.errors import GGUFFormatError
from minivllm.gguf.dequant import dequantize
from minivllm.gguf.reader import GGUFFile
from minivllm.kernels.kernel_options import KernelOptions
from minivllm.kernels.linear import QuantEmbedding, QuantLinear
from minivllm.kernels.quant_weight import QuantizedWeight
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

    def blocks(self, name: str, shape: tuple[int, int]) -> QuantizedWeight:
        """The tensor as GGUF blocks on the device, without dequantizing."""
        info = self.gf.tensor_info(name)
        if tuple(info.shape) != tuple(shape):
            raise GGUFFormatError(
                f"{self.gf.path}: tensor {name!r} has shape {info.shape}, expected {shape} "
                f"from the file's own hyper-parameters; the file is inconsistent"
            )
        raw = self.gf.tensor_bytes(name).to(self.device)
        if self.progress is not None:
            self.progress.update(info.nbytes)
        return QuantizedWeight(raw, info.ggml_type, shape, name)

    def maybe(self, name: str, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        return self.get(name, dtype, shape) if name in self.gf.tensors else None


def load_model(gf: GGUFFile, device: torch.device, dtype: torch.dtype, *, progress: bool = True,
               kernel_options: KernelOptions | None = None) -> DecoderModel:
    cfg = ModelConfig.from_gguf(gf)
    # One options object shared by every layer; the engine updates it in place.
    options = (kernel_options or KernelOptions()).resolved(device)
    total = sum(t.nbytes for t in gf.tensors.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"loading {gf.path.name}", disable=not progress)
    ld = _TensorLoader(gf, device, bar)
    f32 = torch.float32
    # The CPU fast mode (dtype=bfloat16 on a CPU): bf16 or int8 only inside the matmuls
    # (bf16 GEMM through oneDNN, the int8-activation GEMV), everything between them, K/V
    # included, in float32. bf16 activations between the ops bought no speed on the CPU
    # (no bf16 attention or norm kernels there) and cost conversions on every op.
    model_dtype = f32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype
    out_dtype = None if model_dtype == dtype else f32
    q_out = cfg.n_heads * cfg.head_dim
    kv_out = cfg.n_kv_heads * cfg.head_dim

    def linear(prefix: str, out_f: int, in_f: int, compute_dtype: torch.dtype = dtype) -> QuantLinear:
        w = ld.blocks(f"{prefix}.weight", (out_f, in_f))
        b = ld.maybe(f"{prefix}.bias", f32, (out_f,))
        return QuantLinear(w, b, options=options, compute_dtype=compute_dtype, name=prefix.rsplit(".", 1)[-1],
                           out_dtype=out_dtype)

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
    # near-ties often enough to drop greedy agreement with f32 below 99%. A tied
    # embedding shares the LM head's blocks (one copy on the device).
    embd = ld.blocks("token_embd.weight", (cfg.vocab_size, cfg.d_model))
    embedding = QuantEmbedding(embd, options=options)
    if cfg.tied_embeddings:
        output = QuantLinear(embd, None, options=options, compute_dtype=f32, name="output")
    else:
        output = linear("output", cfg.vocab_size, cfg.d_model, compute_dtype=f32)
    freq_factors = ld.get("rope_freqs.weight", f32, (cfg.rope_dim // 2,)) if cfg.has_rope_freqs else None
    rope = RotaryEmbedding(cfg.rope_dim, cfg.rope_base, cfg.rope_style, freq_factors=freq_factors,
                           linear_factor=cfg.rope_linear_factor, device=device)
    model = DecoderModel(cfg, embedding, layers, ld.get("output_norm.weight", f32, (cfg.d_model,)),
                         output, rope, model_dtype, device, options)
    model.matmul_dtype = dtype  # what the user asked for: the matmuls' precision
    model.fuse_projections()  # GPU path: Q/K/V and gate/up one weight each (MINIVLLM_FUSED_PROJECTIONS=0: not)
    bar.close()
    return model
