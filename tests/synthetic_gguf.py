"""Tiny but complete Llama / Qwen2 GGUF models, written on the fly for tests.

No real file covers every ggml type, separate vs tied output embeddings, Llama 3
`rope_freqs` and linear RoPE scaling, so `write_tiny_model` makes one that does:
every hyper-parameter key the loaders read, a small byte-level BPE vocabulary
(`tokenizer.ggml.model = "gpt2"`, with merges), and seeded random weights.

* Matmul weights (token_embd, output, attn_q/k/v/output, ffn_gate/up/down) are stored in
  `weight_type`; norms, biases and `rope_freqs` are F32.
* F32/F16/BF16 and the legacy 32-element quants (Q4_0 … Q8_0) are random normal weights
  converted with `gguf.quants.quantize`.
* gguf-py cannot quantize k-quants, so Q2_K … Q6_K tensors are random *packed blocks*:
  random quant bits and sub-block scales, with positive f16 super-block scales chosen
  so the decoded weights have the requested standard deviation. The weights are then
  whatever those blocks decode to — which is all a comparison needs, since every
  implementation under test reads the same bytes.
* Llama files store Q/K rows permuted for adjacent-pair RoPE (llama.cpp's converter).
  The weights are random, so nothing is permuted here: they are simply *read* in that
  convention (transformers un-permutes on load, minivllm rotates adjacent pairs).

Also here, so GPU runs and other tests can reuse them: `llama3_rope_freqs` (the factors
llama.cpp's converter stores), `minivllm_logits`, and `transformers_logits` (the
independent reference: transformers' own GGUF loader, which dequantizes with gguf-py's
numpy code).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf import quants as gq

T = GGMLQuantizationType

FLOAT_TYPES: tuple[GGMLQuantizationType, ...] = (T.F32, T.F16, T.BF16)
LEGACY_QUANT_TYPES: tuple[GGMLQuantizationType, ...] = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_QUANT_TYPES: tuple[GGMLQuantizationType, ...] = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)
ALL_WEIGHT_TYPES: tuple[GGMLQuantizationType, ...] = FLOAT_TYPES + LEGACY_QUANT_TYPES + K_QUANT_TYPES

# k-quant super-block scales: byte offset of f16 `d`, of f16 `dmin` (None: no min), and
# dmin/d so that the decoded weights come out roughly zero-mean
# (mean x = d·E[sc]·E[q] − dmin·E[m]; with uniform random bits E[sc] = E[m]).
_K_SCALES: dict[GGMLQuantizationType, tuple[int, int | None, float]] = {
    T.Q2_K: (80, 82, 1.5),  # q in 0..3
    T.Q3_K: (108, None, 0.0),  # q in -4..3, sc - 32 in -32..31: already centred
    T.Q4_K: (0, 2, 7.5),  # q in 0..15
    T.Q5_K: (0, 2, 15.5),  # q in 0..31
    T.Q6_K: (208, None, 0.0),  # q - 32 in -32..31, int8 scales
}

SUPPORTED_ARCHS = ("llama", "qwen2")

# token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL = 1, 3
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


# --- vocabulary -------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _merge_stream() -> Iterator[tuple[str, str]]:
    """Endless valid merges: every pair of frequent characters, then longer tokens + char.

    Each merge's parts exist before it (bytes, or the result of an earlier merge).
    """
    b2u = _bytes_to_unicode()
    alphabet = [b2u[ord(c)] for c in " etaoinshrdlcumwfgypbvkjxqz"]  # ' ' is 'Ġ'
    seen: set[str] = set()
    level = alphabet
    while True:
        nxt = []
        for a in level:
            for b in alphabet:
                if a + b in seen:
                    continue
                seen.add(a + b)
                nxt.append(a + b)
                yield a, b
        level = nxt


def tiny_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 byte tokens, merges, then SPECIAL_TOKENS last."""
    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    stream = _merge_stream()
    for _ in range(n_merges):
        a, b = next(stream)
        merges.append(f"{a} {b}")
        tokens.append(a + b)
    tokens += list(SPECIAL_TOKENS)
    types = [_NORMAL] * (vocab_size - len(SPECIAL_TOKENS)) + [_CONTROL] * len(SPECIAL_TOKENS)
    return tokens, types, merges


# --- weights ----------------------------------------------------------------------------


def _k_quant_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, std: float,
                    rng: np.random.Generator) -> np.ndarray:
    """Random valid k-quant blocks for a (rows, cols) tensor, as (rows, row_bytes) uint8."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    d_at, dmin_at, ratio = _K_SCALES[qtype]
    d = rng.uniform(0.5, 1.0, n_blocks).astype(np.float32)
    dmin = d * ratio * rng.uniform(0.8, 1.2, n_blocks).astype(np.float32) if dmin_at is not None else None

    def put(d_vals: np.ndarray, dmin_vals: np.ndarray | None) -> None:
        blocks[:, d_at : d_at + 2] = d_vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
        if dmin_at is not None:
            blocks[:, dmin_at : dmin_at + 2] = dmin_vals.astype(np.float16).view(np.uint8).reshape(-1, 2)

    put(d, dmin)
    # x is linear in (d, dmin): one rescale of both gives the requested spread.
    decoded = gq.dequantize(blocks.reshape(rows, -1), qtype)
    scale = std / float(decoded.std())
    put(d * scale, None if dmin is None else dmin * scale)
    return blocks.reshape(rows, -1)


def encode_weight(w: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator,
                  std: float) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """(data, raw_dtype) for `GGUFWriter.add_tensor`, storing the 2-D weight `w` as `qtype`.

    For k-quants `w` only gives the shape: the blocks are random (see module docstring).
    """
    if qtype == T.F32:
        return np.ascontiguousarray(w, dtype=np.float32), None
    if qtype == T.F16:
        return w.astype(np.float16), None
    if qtype in (T.BF16, *LEGACY_QUANT_TYPES):
        return gq.quantize(w.astype(np.float32), qtype), qtype
    if qtype in K_QUANT_TYPES:
        return _k_quant_blocks(w.shape[0], w.shape[1], qtype, std, rng), qtype
    # Anything else (an "unsupported" type for error tests): random bytes of the right size.
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if w.shape[-1] % block_size:
        raise ValueError(f"row length {w.shape[-1]} is not a multiple of the {qtype.name} block size {block_size}")
    raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block_size * type_size), dtype=np.uint8)
    return raw, qtype


def llama3_rope_freqs(head_dim: int, base: float, *, factor: float = 8.0, low_freq_factor: float = 1.0,
                      high_freq_factor: float = 4.0, original_max_position_embeddings: int = 8192) -> np.ndarray:
    """Llama 3.1's per-frequency RoPE divisors, as llama.cpp's converter writes `rope_freqs`.

    From Meta's `apply_scaling` (llama3.1 reference code): a frequency whose wavelength is
    shorter than `orig / high_freq_factor` is kept, one longer than `orig / low_freq_factor`
    is divided by `factor`, and in between it is interpolated with
    `smooth = (orig / wavelen - low) / (high - low)`, new = (1 - smooth) * f / factor + smooth * f.
    The file stores the *divisor* f / new (llama.cpp's `rope_freqs`, one per frequency).
    """
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# --- the file ----------------------------------------------------------------------------


def write_tiny_model(
    path: str | Path,
    *,
    arch: str = "llama",
    weight_type: GGMLQuantizationType = T.F32,
    n_layers: int = 2,
    d_model: int = 256,
    d_ff: int = 512,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    vocab_size: int = 512,
    context_length: int = 4096,
    rope_base: float = 10000.0,
    rms_eps: float = 1e-5,
    rope_freqs: np.ndarray | None = None,
    rope_linear_factor: float | None = None,
    tied: bool = True,
    seed: int = 0,
    weight_std: float = 0.08,
    omit: Iterable[str] = (),
    type_overrides: Mapping[str, GGMLQuantizationType] | None = None,
    architecture_override: str | None = None,
    token_type_overrides: Mapping[int, int] | None = None,
) -> Path:
    """Write a small, complete `arch` model to `path` and return the path.

    Deterministic: the same arguments (and gguf-py version) give the same bytes.
    `rope_freqs`: written as the F32 tensor `rope_freqs.weight` (Llama 3 scaling).
    `rope_linear_factor`: writes `{arch}.rope.scaling.type = "linear"` and the factor.
    `tied=False` adds a separate `output.weight`.
    For error tests: `omit` drops tensors by name, `type_overrides` stores named matmul
    weights in another type (unsupported ones get random bytes of the right size), and
    `architecture_override` writes another `general.architecture` (and key prefix);
    `token_type_overrides` gives token ids another llama.cpp token type (5 = UNUSED: a
    vocabulary that cannot spell some bytes).
    Row lengths must be multiples of the block size: 256 for k-quants.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    head_dim = d_model // n_heads
    if head_dim * n_heads != d_model or n_heads % n_kv_heads:
        raise ValueError("d_model must split into n_heads heads, and n_heads into n_kv_heads groups")
    block = GGML_QUANT_SIZES[weight_type][0]
    for name, n in (("d_model", d_model), ("d_ff", d_ff), ("n_heads*head_dim", n_heads * head_dim)):
        if n % block:
            raise ValueError(f"{name}={n} is not a multiple of the {weight_type.name} block size {block}")
    omit = set(omit)
    type_overrides = dict(type_overrides or {})
    rng = np.random.default_rng(seed)
    path = Path(path)
    file_arch = architecture_override or arch

    w = GGUFWriter(str(path), arch=file_arch)
    w.add_name(f"tiny-{arch}-{weight_type.name}")
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(rope_base)
    w.add_rope_dimension_count(head_dim)
    if rope_linear_factor is not None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope_linear_factor))
    w.add_file_type(int(weight_type))  # informative only (llama_ftype values differ slightly)

    tokens, types, merges = tiny_vocab(vocab_size)
    for token_id, kind in (token_type_overrides or {}).items():
        types[token_id] = kind
    eos = tokens.index("<|endoftext|>")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(arch == "llama")

    def matmul(name: str, rows: int, cols: int) -> None:
        qtype = type_overrides.get(name, weight_type)
        data, raw_dtype = encode_weight(rng.normal(0.0, weight_std, (rows, cols)).astype(np.float32), qtype,
                                        rng, weight_std)
        if name not in omit:
            w.add_tensor(name, data, raw_dtype=raw_dtype)

    def f32(name: str, values: np.ndarray) -> None:
        if name not in omit:
            w.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))

    def norm(name: str, n: int) -> None:
        f32(name, 1.0 + 0.1 * rng.standard_normal(n))

    q_out, kv_out = n_heads * head_dim, n_kv_heads * head_dim
    matmul("token_embd.weight", vocab_size, d_model)
    for i in range(n_layers):
        p = f"blk.{i}"
        norm(f"{p}.attn_norm.weight", d_model)
        matmul(f"{p}.attn_q.weight", q_out, d_model)
        matmul(f"{p}.attn_k.weight", kv_out, d_model)
        matmul(f"{p}.attn_v.weight", kv_out, d_model)
        if arch == "qwen2":
            f32(f"{p}.attn_q.bias", 0.1 * rng.standard_normal(q_out))
            f32(f"{p}.attn_k.bias", 0.1 * rng.standard_normal(kv_out))
            f32(f"{p}.attn_v.bias", 0.1 * rng.standard_normal(kv_out))
        matmul(f"{p}.attn_output.weight", d_model, q_out)
        norm(f"{p}.ffn_norm.weight", d_model)
        matmul(f"{p}.ffn_gate.weight", d_ff, d_model)
        matmul(f"{p}.ffn_up.weight", d_ff, d_model)
        matmul(f"{p}.ffn_down.weight", d_model, d_ff)
    norm("output_norm.weight", d_model)
    if not tied:
        matmul("output.weight", vocab_size, d_model)
    if rope_freqs is not None:
        rope_freqs = np.asarray(rope_freqs, dtype=np.float32)
        if rope_freqs.shape != (head_dim // 2,):
            raise ValueError(f"rope_freqs must have shape ({head_dim // 2},), got {rope_freqs.shape}")
        f32("rope_freqs.weight", rope_freqs)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- running both implementations -------------------------------------------------------


def random_token_ids(n: int, vocab_size: int = 512, seed: int = 1234) -> list[int]:
    """Seeded random prompt ids (specials excluded: they are the last ids of the vocab)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size - len(SPECIAL_TOKENS), n).tolist()


def load_minivllm(path: str | Path, device: str = "cpu", dtype: Any = None, gemv_max_rows: int | None = None):
    """Load with the default kernels (float32 on every path for a float32 model): what the
    transformers comparisons pin at rounding level."""
    import torch

    from minivllm.gguf.reader import GGUFFile
    from minivllm.kernels.kernel_options import KernelOptions
    from minivllm.model.loader import load_model

    return load_model(GGUFFile(path), torch.device(device), dtype or torch.float32, progress=False,
                      kernel_options=KernelOptions(gemv_max_rows=gemv_max_rows))


def minivllm_logits(model, ids: Sequence[int], max_len: int | None = None):
    """All-position logits (T, vocab) float32, one prefill from position 0."""
    import torch

    from minivllm.cache.contiguous import ContiguousKVCache

    c = model.config
    cache = ContiguousKVCache(c.n_layers, max_len or max(64, len(ids)), c.n_kv_heads, c.head_dim,
                              model.dtype, model.device)
    return model.forward(torch.tensor(list(ids), device=model.device), 0, cache, all_logits=True)


def minivllm_greedy(model, prompt: Sequence[int], n_new: int) -> list[int]:
    """Greedy continuation: prefill, then one token at a time through the KV cache."""
    import torch

    from minivllm.cache.contiguous import ContiguousKVCache

    c = model.config
    cache = ContiguousKVCache(c.n_layers, len(prompt) + n_new, c.n_kv_heads, c.head_dim, model.dtype, model.device)
    logits = model.forward(torch.tensor(list(prompt), device=model.device), 0, cache)
    out: list[int] = []
    pos = len(prompt)
    for _ in range(n_new):
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        logits = model.forward(torch.tensor([nxt], device=model.device), pos, cache)
        pos += 1
    return out


def transformers_model(path: str | Path, rope_parameters: Mapping[str, Any] | None = None):
    """transformers' own GGUF load of `path` in float32 (its legacy loader: gguf-py numpy
    dequantization, Llama Q/K un-permuted). transformers' GGUF config reader ignores
    `rope.scaling.*` and `rope_freqs` for llama/qwen2, so RoPE scaling, when the file has
    any, must be given as `rope_parameters` (merged over the file's `rope_theta`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if rope_parameters is not None:
        config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **rope_parameters}
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, local_files_only=True, dtype=torch.float32
    )
    return model.eval()


def transformers_logits(model, ids: Sequence[int]):
    import torch

    with torch.inference_mode():
        return model(torch.tensor([list(ids)])).logits[0].float()


def transformers_greedy(model, prompt: Sequence[int], n_new: int) -> list[int]:
    """Greedy continuation by full recomputation (no cache: independent of any KV logic)."""
    import torch

    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n_new):
            ids.append(int(torch.argmax(model(torch.tensor([ids])).logits[0, -1])))
    return ids[len(prompt):]
