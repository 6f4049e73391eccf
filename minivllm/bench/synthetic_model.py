"""A Qwen2.5-7B Q4_K_M stand-in with random weights, for GPU speed measurements.

Speed depends on a model's tensor names, shapes and ggml types, not on what the weights
say, so a file with Qwen2.5-7B-Instruct Q4_K_M's exact layout and random *valid* blocks
measures the kernels as the real file would, without a 4.7 GB download:

* the layout of the published model: 28 layers, d_model 3584, 28 query heads / 4 KV
  heads of 128, d_ff 18944, vocab 152064 (untied `output.weight`), F32 norms and Q/K/V
  biases, RoPE base 1e6, RMS eps 1e-6;
* llama.cpp's Q4_K_M type choice (`llama_tensor_get_type`, src/llama-quant.cpp): Q4_K
  everywhere, except `output.weight` in Q6_K and `attn_v` / `ffn_down` in Q6_K for the
  layers where `use_more_bits(i, n)` holds: i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2.
  For 28 layers that is layers 0-2, 5, 8, 11, 14, 17, 20, 23-27 (14 of 28);
* tokenizer and chat-template metadata copied from a real Qwen2.5 GGUF (same vocabulary),
  padded to the model's 152064 rows with `[PAD<i>]` UNUSED tokens, as llama.cpp's converter
  does, so every id the model can emit decodes;
* random blocks whose scales are set so every matmul's output has about unit spread for a
  unit-RMS input (weight std 1/sqrt(fan_in)), with zero-mean sub-blocks: activations stay
  finite through all 28 layers in f16/bf16 and generation runs without NaNs.

The file is written tensor by tensor (`GGUFWriter` header, then one tensor's bytes at a
time), so memory stays at one tensor (the largest, `output.weight`, is 447 MB), and under a
temporary name renamed at the end, so a cached file is always complete.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter

from minivllm.errors import ConfigError
from minivllm.gguf.reader import GGUFFile
from minivllm.models.cache import model_dir

T = GGMLQuantizationType

# Bumped whenever the bytes this module writes change, so a cached file of an older
# version is regenerated instead of silently reused.
FORMAT_VERSION = 1
MOSTLY_Q4_K_M = 15  # llama_ftype LLAMA_FTYPE_MOSTLY_Q4_K_M, stored as general.file_type
TOKEN_TYPE_UNUSED = 5  # llama_token_type LLAMA_TOKEN_TYPE_UNUSED
EMBEDDING_STD = 0.02  # token_embd: the residual's starting point; every sublayer sees it RMS-normalized


@dataclass(frozen=True)
class SyntheticSpec:
    """Hyper-parameters of a Qwen2-architecture model. Row lengths (d_model, d_ff and
    n_heads * head_dim) must be multiples of 256, the k-quant block size."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    context_length: int = 32768
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    # llama.cpp's rule for rows that are not whole 256-element super-blocks (d_model 896):
    # such tensors take Q5_0 instead of Q4_K and Q8_0 instead of Q6_K. Off: refuse them.
    kquant_fallback: bool = False
    # Which layers get llama.cpp's extra bits: use_more_bits(k) for the k-th layer in the
    # order the quantizer met them. Some published files were quantized from tensors in
    # lexicographic order (blk.0, blk.1, blk.10, ...), as the real Qwen2.5-0.5B one was.
    more_bits_lexicographic: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self, *, quantized: bool = True) -> None:
        """`quantized=False` checks only the shapes (a plan of names and shapes needs no blocks)."""
        if self.n_layers < 1:
            raise ConfigError("n_layers", self.n_layers, "must be >= 1")
        if self.head_dim * self.n_heads != self.d_model or self.n_heads % self.n_kv_heads:
            raise ConfigError("n_heads", self.n_heads,
                              "d_model must split into n_heads equal heads, and n_heads into n_kv_heads groups")
        for field, n in (("d_model", self.d_model), ("d_ff", self.d_ff)):
            if quantized and n % (32 if self.kquant_fallback else 256):
                raise ConfigError(
                    field,
                    n,
                    "must be a multiple of 32 (the Q5_0/Q8_0 block size)"
                    if self.kquant_fallback
                    else "must be a multiple of 256 (the Q4_K/Q6_K block size)",
                )


QWEN25_7B = SyntheticSpec(name="qwen2.5-7b-q4_k_m", n_layers=28, d_model=3584, n_heads=28, n_kv_heads=4,
                          d_ff=18944, vocab_size=152064)
# A draft for the 7B, sized like Qwen2.5-0.5B (24 layers, 2 KV heads of 64, d_ff 4864)
# but with d_model 1024 instead of 896: this generator writes k-quants only, whose rows
# must be multiples of 256 (the real 0.5B's "Q4_K_M" falls back to Q5_0/Q8_0 there). Same
# vocabulary rows as the 7B, so the two make a tokenizer-identical speculative pair.
QWEN25_05B_CLASS = SyntheticSpec(name="qwen2.5-0.5b-class-q4_k_m", n_layers=24, d_model=1024, n_heads=16,
                                 n_kv_heads=2, d_ff=4864, vocab_size=152064)
# Qwen2.5-0.5B-Instruct Q4_K_M exactly: d_model 896 is not a whole number of super-blocks,
# so llama.cpp's fallback gives Q5_0 / Q8_0 for the tensors whose rows are 896 long
# (token_embd Q5_0, output Q8_0, attn_v Q8_0 or Q5_0, everything else on 896-long rows
# Q5_0; ffn_down Q6_K / Q4_K), as in the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file,
# whose tensor bytes this plan reproduces (tests/integration/model/test_synthetic_model.py).
QWEN25_05B = SyntheticSpec(name="qwen2.5-0.5b-q4_k_m", n_layers=24, d_model=896, n_heads=14, n_kv_heads=2,
                           d_ff=4864, vocab_size=151936, kquant_fallback=True, more_bits_lexicographic=True)
SPECS = {QWEN25_7B.name: QWEN25_7B, QWEN25_05B_CLASS.name: QWEN25_05B_CLASS, QWEN25_05B.name: QWEN25_05B}
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: (out_features, in_features) for matrices
    ggml_type: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return math.prod(self.shape) // block_size * type_size


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers that get Q6_K attn_v / ffn_down in Q4_K_M."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def plan_tensors(spec: SyntheticSpec) -> list[TensorPlan]:
    """Every tensor of the Q4_K_M file, in writing order."""
    spec.validate(quantized=False)
    d, q_out, kv_out = spec.d_model, spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    plan = [TensorPlan("token_embd.weight", (spec.vocab_size, d), T.Q4_K)]
    order = sorted(range(spec.n_layers), key=str) if spec.more_bits_lexicographic else list(range(spec.n_layers))
    more_layers = {layer for k, layer in enumerate(order) if use_more_bits(k, spec.n_layers)}
    for i in range(spec.n_layers):
        p = f"blk.{i}"
        more = T.Q6_K if i in more_layers else T.Q4_K
        plan += [
            TensorPlan(f"{p}.attn_norm.weight", (d,), T.F32),
            TensorPlan(f"{p}.attn_q.weight", (q_out, d), T.Q4_K),
            TensorPlan(f"{p}.attn_q.bias", (q_out,), T.F32),
            TensorPlan(f"{p}.attn_k.weight", (kv_out, d), T.Q4_K),
            TensorPlan(f"{p}.attn_k.bias", (kv_out,), T.F32),
            TensorPlan(f"{p}.attn_v.weight", (kv_out, d), more),
            TensorPlan(f"{p}.attn_v.bias", (kv_out,), T.F32),
            TensorPlan(f"{p}.attn_output.weight", (d, q_out), T.Q4_K),
            TensorPlan(f"{p}.ffn_norm.weight", (d,), T.F32),
            TensorPlan(f"{p}.ffn_gate.weight", (spec.d_ff, d), T.Q4_K),
            TensorPlan(f"{p}.ffn_up.weight", (spec.d_ff, d), T.Q4_K),
            TensorPlan(f"{p}.ffn_down.weight", (d, spec.d_ff), more),
        ]
    plan += [TensorPlan("output_norm.weight", (d,), T.F32),
             TensorPlan("output.weight", (spec.vocab_size, d), T.Q6_K)]
    if spec.kquant_fallback:
        plan = [replace(t, ggml_type=_FALLBACK[t.ggml_type]) if t.ggml_type in _FALLBACK and t.shape[-1] % 256 else t
                for t in plan]
    return plan


# --- random valid blocks ---------------------------------------------------------------
#
# Per block, the super-block scale is d = base * u with u ~ U(0.5, 1.5) (E[u^2] = 13/12),
# so blocks differ as in a real file; `base` is solved from the target std analytically.

_U_SQ = 13.0 / 12.0
# Q4_K: 6-bit sub-block scales sc in 1..63 with min m = sc and dmin = 7.5 d, so a value is
# d * sc * (q - 7.5) with q in 0..15: every sub-block is zero-mean.
# E[sc^2] = sum(1..63 squared) / 63, Var(q - 7.5) = (16^2 - 1) / 12.
_Q4_K_STD_PER_D = math.sqrt(sum(s * s for s in range(1, 64)) / 63 * (16 * 16 - 1) / 12)
# Q6_K: int8 sub-block scales, magnitude 1..127 with a random sign; value d * sc * (q - 32)
# with q in 0..63: E[(q - 32)^2] = (64^2 - 1) / 12 + 0.25.
_Q6_K_STD_PER_D = math.sqrt(sum(s * s for s in range(1, 128)) / 127 * ((64 * 64 - 1) / 12 + 0.25))


def _super_scales(rng: np.random.Generator, n_blocks: int, std: float, std_per_d: float) -> np.ndarray:
    base = std / (std_per_d * math.sqrt(_U_SQ))
    return (base * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)


def q4_k_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """(n_blocks, 144) uint8: Q4_K blocks decoding to zero-mean values of about `std` spread."""
    blocks = np.frombuffer(rng.bytes(n_blocks * 144), dtype=np.uint8).reshape(n_blocks, 144).copy()
    d = _super_scales(rng, n_blocks, std, _Q4_K_STD_PER_D)
    blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    blocks[:, 2:4] = (d.astype(np.float32) * 7.5).astype(np.float16).view(np.uint8).reshape(-1, 2)
    sc = rng.integers(1, 64, (n_blocks, 8), dtype=np.uint8)
    m = sc  # min = scale: see _Q4_K_STD_PER_D
    # ggml's get_scale_min_k4 packing: bytes 0-3 / 4-7 hold scales / mins 0-3 in their low
    # 6 bits and the top 2 bits of scales / mins 4-7; bytes 8-11 hold the low nibbles of 4-7.
    blocks[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    blocks[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    blocks[:, 12:16] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return blocks


def q6_k_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """(n_blocks, 210) uint8: Q6_K blocks (ql, qh, 16 int8 scales, f16 d) of about `std` spread."""
    blocks = np.frombuffer(rng.bytes(n_blocks * 210), dtype=np.uint8).reshape(n_blocks, 210).copy()
    mag = rng.integers(1, 128, (n_blocks, 16), dtype=np.int16)
    sign = np.where(rng.random((n_blocks, 16)) < 0.5, -1, 1).astype(np.int16)
    blocks[:, 192:208] = (mag * sign).astype(np.int8).view(np.uint8)
    blocks[:, 208:210] = _super_scales(rng, n_blocks, std, _Q6_K_STD_PER_D).view(np.uint8).reshape(-1, 2)
    return blocks


# Q5_0: value d * (q - 16) with q uniform in 0..31 (random nibbles and high bits).
_Q5_0_STD_PER_D = math.sqrt((32 * 32 - 1) / 12 + 0.25)
# Q8_0: value d * q with q uniform in -127..127.
_Q8_0_STD_PER_D = math.sqrt(sum(q * q for q in range(-127, 128)) / 255)


def q5_0_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """(n_blocks, 22) uint8: Q5_0 blocks (f16 d, 32 high bits, 16 nibble bytes) of about `std` spread."""
    blocks = np.frombuffer(rng.bytes(n_blocks * 22), dtype=np.uint8).reshape(n_blocks, 22).copy()
    blocks[:, 0:2] = _super_scales(rng, n_blocks, std, _Q5_0_STD_PER_D).view(np.uint8).reshape(-1, 2)
    return blocks


def q8_0_blocks(rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
    """(n_blocks, 34) uint8: Q8_0 blocks (f16 d, 32 int8 in -127..127) of about `std` spread."""
    blocks = np.empty((n_blocks, 34), dtype=np.uint8)
    blocks[:, 0:2] = _super_scales(rng, n_blocks, std, _Q8_0_STD_PER_D).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = rng.integers(-127, 128, (n_blocks, 32), dtype=np.int8).view(np.uint8)
    return blocks


_BLOCK_WRITERS = {T.Q4_K: q4_k_blocks, T.Q6_K: q6_k_blocks, T.Q5_0: q5_0_blocks, T.Q8_0: q8_0_blocks}


def weight_std(t: TensorPlan) -> float:
    """Target spread: 1/sqrt(fan_in) keeps each matmul's output near unit spread."""
    return EMBEDDING_STD if t.name == "token_embd.weight" else 1.0 / math.sqrt(t.shape[1])


def tensor_data(t: TensorPlan, rng: np.random.Generator) -> np.ndarray:
    """The bytes (quantized) or values (F32) `GGUFWriter.write_tensor_data` takes for `t`."""
    if t.ggml_type == T.F32:
        if t.name.endswith("norm.weight"):
            return (1.0 + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)
        return (0.1 * rng.standard_normal(t.shape)).astype(np.float32)  # Q/K/V biases
    rows, cols = t.shape
    block_size, type_size = GGML_QUANT_SIZES[t.ggml_type]
    per_row = cols // block_size
    return _BLOCK_WRITERS[t.ggml_type](rng, rows * per_row, weight_std(t)).reshape(rows, per_row * type_size)


# --- tokenizer metadata ----------------------------------------------------------------


def _value_type(value: object) -> tuple[GGUFValueType, GGUFValueType | None]:
    """The GGUF (type, array element type) for a metadata value as `GGUFFile` returns it."""
    if isinstance(value, bool):
        return GGUFValueType.BOOL, None
    if isinstance(value, int):
        return GGUFValueType.UINT32, None  # token ids
    if isinstance(value, float):
        return GGUFValueType.FLOAT32, None
    if isinstance(value, str):
        return GGUFValueType.STRING, None
    if isinstance(value, np.ndarray):
        return GGUFValueType.ARRAY, _NUMPY_TYPES[value.dtype.type]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return GGUFValueType.ARRAY, GGUFValueType.STRING
    raise TypeError(f"cannot copy metadata value of type {type(value).__name__}")


_NUMPY_TYPES = {np.int32: GGUFValueType.INT32, np.uint32: GGUFValueType.UINT32, np.float32: GGUFValueType.FLOAT32,
                np.int8: GGUFValueType.INT8, np.uint8: GGUFValueType.UINT8}


def _tokenizer_fields(source: Path) -> dict[str, object]:
    """Every `tokenizer.*` key of `source` (minivllm's reader: gguf-py's takes ~40 s on a 150k vocabulary).

    `source` may also be a JSON object of those fields (`.json`, or `.json.xz`), such as
    ../shared/peers/qwen2.5-tokenizer-fields.json.xz: 1 MB, so it travels to an offline GPU
    machine where no Qwen2.5 GGUF is."""
    if source.name.endswith((".json", ".json.xz")):
        import json
        import lzma

        opener = lzma.open if source.name.endswith(".xz") else open
        with opener(source, "rt", encoding="utf-8") as f:
            fields = json.load(f)
        fields = {k: v for k, v in fields.items() if k.startswith("tokenizer.")}
        if "tokenizer.ggml.token_type" in fields:
            fields["tokenizer.ggml.token_type"] = np.asarray(fields["tokenizer.ggml.token_type"], dtype=np.int32)
        return fields
    with GGUFFile(source) as gf:
        return {k: v for k, v in gf.metadata.items() if k.startswith("tokenizer.")}


def default_tokenizer_source() -> Path:
    """A real Qwen2.5 GGUF to copy the tokenizer from: $MINIVLLM_QWEN_TOKENIZER_GGUF, else
    the cached `qwen2.5-coder-0.5b` registry model (downloaded if needed)."""
    env = os.environ.get("MINIVLLM_QWEN_TOKENIZER_GGUF")
    if env:
        return Path(env)
    from minivllm.models import resolve_model

    return Path(resolve_model("qwen2.5-coder-0.5b", progress=False))


# --- the file --------------------------------------------------------------------------


def write_synthetic_model(
    path: str | Path,
    spec: SyntheticSpec = QWEN25_7B,
    *,
    tokenizer_source: str | Path | None = None,
    seed: int = 0,
    progress: bool = False,
) -> Path:
    """Write `spec` as a Q4_K_M GGUF with random weights to `path`; returns the path."""
    path = Path(path)
    source = Path(tokenizer_source) if tokenizer_source is not None else default_tokenizer_source()
    if not source.is_file():
        raise ConfigError(
            "tokenizer_source", str(source), "give the path of a Qwen2.5 GGUF file to copy the tokenizer from"
        )
    spec.validate()
    plan = plan_tensors(spec)
    rng = np.random.default_rng(seed)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # two writers at once never share a file
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(tmp), arch="qwen2")
    try:
        w.add_name(f"{spec.name} synthetic (random weights, minivllm v{FORMAT_VERSION})")
        w.add_context_length(spec.context_length)
        w.add_embedding_length(spec.d_model)
        w.add_block_count(spec.n_layers)
        w.add_feed_forward_length(spec.d_ff)
        w.add_head_count(spec.n_heads)
        w.add_head_count_kv(spec.n_kv_heads)
        w.add_rope_freq_base(spec.rope_base)
        w.add_layer_norm_rms_eps(spec.rms_eps)
        w.add_file_type(MOSTLY_Q4_K_M)
        w.add_quantization_version(2)
        _copy_tokenizer(w, source, spec.vocab_size)
        for t in plan:
            if t.ggml_type == T.F32:
                w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes)
            else:  # gguf-py takes quantized tensors by their byte shape
                w.add_tensor_info(t.name, (t.shape[0], t.nbytes // t.shape[0]), np.dtype(np.uint8), t.nbytes,
                                  raw_dtype=t.ggml_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for k, t in enumerate(plan):
            w.write_tensor_data(tensor_data(t, rng))
            if progress and (k % 12 == 0 or k == len(plan) - 1):
                print(f"synthetic model: {k + 1}/{len(plan)} tensors written", flush=True)
    finally:
        w.close()
    os.replace(tmp, path)
    return path


def _copy_tokenizer(w: GGUFWriter, source: Path, vocab_size: int) -> None:
    fields = _tokenizer_fields(source)
    if "tokenizer.ggml.tokens" not in fields:
        raise ConfigError("tokenizer_source", str(source), "that GGUF has no tokenizer; give a Qwen2.5 GGUF file")
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = np.asarray(fields["tokenizer.ggml.token_type"], dtype=np.int32)
    if len(tokens) > vocab_size:
        raise ConfigError("vocab_size", vocab_size,
                          f"must be at least the tokenizer's {len(tokens)} tokens (every token id must have a row)")
    # The embedding has more rows than the tokenizer has tokens: name the rest, as llama.cpp does.
    pad = range(len(tokens), vocab_size)
    fields["tokenizer.ggml.tokens"] = tokens + [f"[PAD{i}]" for i in pad]
    fields["tokenizer.ggml.token_type"] = np.concatenate([types, np.full(len(pad), TOKEN_TYPE_UNUSED, np.int32)])
    for key, value in fields.items():
        vtype, sub = _value_type(value)
        w.add_key_value(key, value.tolist() if isinstance(value, np.ndarray) else value, vtype, sub_type=sub)


def synthetic_model_path(name: str) -> Path:
    """Where the cached synthetic file lives (under the minivllm model cache)."""
    if name not in SPECS:
        raise ConfigError("synthetic", name, f"allowed: {', '.join(SPECS)}")
    return model_dir(f"synthetic-{name}") / f"{name}-synthetic-v{FORMAT_VERSION}.gguf"


def ensure_synthetic_model(name: str, *, tokenizer_source: str | Path | None = None, progress: bool = True) -> Path:
    """The cached synthetic model `name`, written first if it is not there yet."""
    path = synthetic_model_path(name)
    if not path.is_file():
        if progress:
            print(f"writing synthetic model {name} to {path} (one-time)", flush=True)
        write_synthetic_model(path, SPECS[name], tokenizer_source=tokenizer_source, progress=progress)
    return path


def scaled_down(spec: SyntheticSpec = QWEN25_7B, **changes) -> SyntheticSpec:
    """`spec` with some hyper-parameters replaced (tests write small files this way)."""
    return replace(spec, **changes)
