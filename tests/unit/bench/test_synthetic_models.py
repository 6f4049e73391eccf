"""minivllm on tiny synthetic GGUF models, against transformers loading the same files.

The files (tests/synthetic_gguf.py) cover what no real model file does: every ggml weight
type minivllm dequantizes, on both architectures; tied and separate output embeddings;
Llama 3 `rope_freqs`; linear RoPE scaling; and broken files for the error paths.

The reference is always independent of minivllm: `transformers.AutoModelForCausalLM`
loading the same GGUF in float32 (its GGUF loader dequantizes with gguf-py's numpy code and
un-permutes Llama Q/K itself), or transformers' RoPE functions. transformers' GGUF config
reader ignores `rope.scaling.*` and `rope_freqs` for llama/qwen2, so for those files the
matching RoPE scaling is configured on the transformers side explicitly (the file is still
loaded through its GGUF path; only `config.rope_parameters` is set before the model is built).

Each reference model is loaded once per session and only its outputs are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic_gguf import (
    ALL_WEIGHT_TYPES,
    T,
    llama3_rope_freqs,
    load_minivllm,
    minivllm_greedy,
    minivllm_logits,
    random_token_ids,
    transformers_greedy,
    transformers_logits,
    transformers_model,
    write_tiny_model,
)

from minivllm.cache.contiguous import ContiguousKVCache
from minivllm.errors import MissingTensorError, UnsupportedArchitectureError, UnsupportedTensorTypeError
from minivllm.gguf.reader import GGUFFile
from minivllm.kernels.rope import RotaryEmbedding
from minivllm.model.config import ModelConfig
from minivllm.model.loader import load_model

LOGITS_RTOL = 1e-4  # max |minivllm - transformers| / max |transformers|, float32
INCREMENTAL_RTOL = 1e-5  # one-token-at-a-time decode vs one prefill, same implementation
PROMPT_LEN = 24
LONG_PROMPT_LEN = 96  # RoPE-scaling cases: positions where the scaled frequencies have turned
GREEDY_NEW = 8

LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
LLAMA3_BASE = 500000.0  # Llama 3's rope_theta: about half the frequencies are then scaled
LINEAR_FACTOR = 2.0

# A subset of types on qwen2 keeps the runtime down: one of each family (float, legacy
# quant with and without min, k-quant with and without min).
QWEN2_TYPES = (T.F16, T.BF16, T.Q4_0, T.Q5_1, T.Q3_K, T.Q4_K, T.Q6_K)


@dataclass(frozen=True)
class Case:
    arch: str
    wtype: T
    tied: bool = True
    rope: str = "none"  # "none" | "llama3" | "linear"

    @property
    def id(self) -> str:
        parts = [self.arch, self.wtype.name]
        if not self.tied:
            parts.append("untied")
        if self.rope != "none":
            parts.append(self.rope)
        return "-".join(parts)

    @property
    def prompt_len(self) -> int:
        return LONG_PROMPT_LEN if self.rope != "none" else PROMPT_LEN

    def write(self, directory: Path, *, scaled: bool = True) -> Path:
        """The case's file; `scaled=False` writes the same weights without RoPE scaling."""
        kw: dict = dict(arch=self.arch, weight_type=self.wtype, tied=self.tied, seed=7)
        if self.rope == "llama3":
            kw.update(rope_base=LLAMA3_BASE, context_length=131072)
            if scaled:
                kw["rope_freqs"] = llama3_rope_freqs(64, LLAMA3_BASE, **LLAMA3)
        elif self.rope == "linear" and scaled:
            kw["rope_linear_factor"] = LINEAR_FACTOR
        suffix = "" if scaled else "-unscaled"
        return write_tiny_model(directory / f"{self.id}{suffix}.gguf", **kw)

    def hf_rope_parameters(self) -> dict | None:
        if self.rope == "llama3":
            return {"rope_type": "llama3", **LLAMA3}
        if self.rope == "linear":
            return {"rope_type": "linear", "factor": LINEAR_FACTOR}
        return None


TYPE_CASES = [Case("llama", t) for t in ALL_WEIGHT_TYPES] + [Case("qwen2", t) for t in QWEN2_TYPES]
UNTIED_CASES = [Case("llama", T.Q8_0, tied=False), Case("qwen2", T.Q5_K, tied=False), Case("llama", T.F32, tied=False)]
ROPE_CASES = [Case("llama", T.F32, rope="llama3"), Case("llama", T.Q8_0, rope="linear"),
              Case("qwen2", T.F16, rope="linear")]
ALL_CASES = TYPE_CASES + UNTIED_CASES + ROPE_CASES


@dataclass
class Reference:
    path: Path
    ids: list[int]  # the prompt
    greedy: list[int]  # transformers' greedy continuation of the prompt
    logits: torch.Tensor  # transformers on ids + greedy[:-1], all positions: (T + GREEDY_NEW - 1, vocab)
    hf_tied: bool

    @property
    def prompt_logits(self) -> torch.Tensor:
        return self.logits[: len(self.ids)]


class References:
    """Writes each case's file and runs transformers on it once per session."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._cache: dict[Case, Reference] = {}

    def __call__(self, case: Case) -> Reference:
        if case not in self._cache:
            path = case.write(self.directory)
            ids = random_token_ids(case.prompt_len, seed=11)
            model = transformers_model(path, rope_parameters=case.hf_rope_parameters())
            greedy = transformers_greedy(model, ids, GREEDY_NEW)
            logits = transformers_logits(model, ids + greedy[:-1])
            self._cache[case] = Reference(path, ids, greedy, logits, bool(model.config.tie_word_embeddings))
            del model
        return self._cache[case]


@pytest.fixture(scope="session")
def refs(tmp_path_factory) -> References:
    return References(tmp_path_factory.mktemp("tiny_gguf"))


@pytest.fixture(scope="module", autouse=True)
def _one_cpu_thread():
    """These matmuls are tiny: one thread is as fast, and several stall badly when the
    machine's two cores are busy with anything else. Restored for the next module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _top2_margin(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float().cpu() - ref.float().cpu()).abs().max() / ref.float().abs().max())


def _check_against_reference(ref: Reference, device: str) -> None:
    """Logits at every prompt position (one prefill) and at every decode step (teacher-forced
    on transformers' greedy tokens, through minivllm's KV cache) vs transformers; greedy
    choices equal wherever the logits tolerance cannot flip them; free-running greedy too."""
    model = load_minivllm(ref.path, device)
    c = model.config
    n_prompt = len(ref.ids)
    cache = ContiguousKVCache(c.n_layers, n_prompt + GREEDY_NEW, c.n_kv_heads, c.head_dim, torch.float32, device)
    prefill = model.forward(torch.tensor(ref.ids, device=device), 0, cache, all_logits=True)
    steps = [model.forward(torch.tensor([tok], device=device), n_prompt + k, cache)
             for k, tok in enumerate(ref.greedy[:-1])]
    got = torch.cat([prefill, torch.stack(steps)]).cpu()
    assert got.shape == ref.logits.shape and got.dtype == torch.float32

    err = _rel_err(got[:n_prompt], ref.prompt_logits)
    assert err <= LOGITS_RTOL, f"prefill: max |diff| / max |ref| = {err:.3g} > {LOGITS_RTOL}"
    err = _rel_err(got[n_prompt:], ref.logits[n_prompt:])
    assert err <= LOGITS_RTOL, f"decode steps: max |diff| / max |ref| = {err:.3g} > {LOGITS_RTOL}"

    # Greedy next token at every position. Two logits each off by at most tol can swap
    # order only if the reference margin is below 2 * tol: those positions are skipped.
    tie = 2 * LOGITS_RTOL * float(ref.logits.abs().max())
    clear = torch.tensor([_top2_margin(row) > tie for row in ref.logits])
    assert int(clear.sum()) >= len(clear) - 2, "too many near-ties in the reference to judge greedy choices"
    assert torch.equal(got.argmax(-1)[clear], ref.logits.argmax(-1)[clear])
    # (sanity of the reference: its greedy tokens are the argmax of its own last rows)
    last = clear[n_prompt - 1 :]
    assert ref.logits[n_prompt - 1 :].argmax(-1)[last].tolist() == torch.tensor(ref.greedy)[last].tolist()

    # Free-running greedy generation: identical up to the first reference near-tie.
    new = minivllm_greedy(model, ref.ids, GREEDY_NEW)
    margins = [_top2_margin(row) for row in ref.logits[n_prompt - 1 :]]
    n_sure = next((i for i, m in enumerate(margins) if m <= tie), GREEDY_NEW)
    assert new[:n_sure] == ref.greedy[:n_sure], (new, ref.greedy)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


# --- every weight type, both architectures -------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", TYPE_CASES, ids=lambda c: c.id)
def test_weight_types_match_transformers(refs, case, device):
    ref = refs(case)
    gf = GGUFFile(ref.path)
    assert {gf.tensors[f"blk.0.{n}.weight"].ggml_type for n in ("attn_q", "ffn_down")} == {case.wtype}
    assert gf.tensors["token_embd.weight"].ggml_type == case.wtype
    _check_against_reference(ref, device)


# --- tied vs separate output embedding -----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", UNTIED_CASES, ids=lambda c: c.id)
def test_separate_output_embedding_matches_transformers(refs, case, device):
    ref = refs(case)
    cfg = ModelConfig.from_gguf(GGUFFile(ref.path))
    assert not cfg.tied_embeddings and not ref.hf_tied
    _check_against_reference(ref, device)
    # The output matrix really is used: the tied file of the same type gives other logits.
    tied = refs(Case(case.arch, case.wtype))
    assert tied.ids == ref.ids
    assert _rel_err(ref.prompt_logits, tied.prompt_logits) > 0.1


def test_tied_output_embedding_has_no_output_tensor(refs):
    ref = refs(TYPE_CASES[0])
    gf = GGUFFile(ref.path)
    assert "output.weight" not in gf.tensors
    assert ModelConfig.from_gguf(gf).tied_embeddings and ref.hf_tied


# --- RoPE scaling ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.id)
def test_rope_scaling_matches_transformers(refs, case, device, tmp_path):
    """Full model vs transformers configured with the same scaling, over 96 positions."""
    ref = refs(case)
    cfg = ModelConfig.from_gguf(GGUFFile(ref.path))
    if case.rope == "llama3":
        assert cfg.has_rope_freqs and cfg.rope_linear_factor == 1.0
    else:
        assert cfg.rope_linear_factor == LINEAR_FACTOR and not cfg.has_rope_freqs
    _check_against_reference(ref, device)

    # Not vacuous: the same weights without the scaling give clearly different logits,
    # and the difference grows with position.
    plain = minivllm_logits(load_minivllm(case.write(tmp_path, scaled=False), device), ref.ids).cpu()
    diff = (plain - ref.prompt_logits).abs().amax(-1) / ref.prompt_logits.abs().max()
    assert float(diff.max()) > 100 * LOGITS_RTOL
    assert float(diff[-16:].mean()) > 2 * float(diff[:16].mean())


def test_llama3_rope_freqs_match_transformers_inv_freq():
    """minivllm's inv_freq from the stored factors vs transformers' `llama3` RoPE init."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factors = llama3_rope_freqs(64, LLAMA3_BASE, **LLAMA3)
    # The published formula's three regimes all occur at this base / head_dim.
    assert (factors == 1.0).any() and (factors == 8.0).any()
    assert ((factors > 1.0) & (factors < 8.0)).any()

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": LLAMA3_BASE, **LLAMA3})
    hf_inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_scaling == 1.0
    rope = RotaryEmbedding(64, LLAMA3_BASE, "adjacent", freq_factors=torch.from_numpy(factors))
    torch.testing.assert_close(rope.inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)
    # and linear scaling vs transformers' `linear` init
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": LINEAR_FACTOR})
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    rope = RotaryEmbedding(64, 10000.0, "halves", linear_factor=LINEAR_FACTOR)
    torch.testing.assert_close(rope.inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=0)


# --- incremental decode == prefill -----------------------------------------------------------


INCREMENTAL_CASES = [Case("llama", T.Q4_K), Case("qwen2", T.Q8_0), Case("llama", T.F32, rope="llama3"),
                     Case("qwen2", T.F16, rope="linear")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", INCREMENTAL_CASES, ids=lambda c: c.id)
def test_incremental_decode_equals_prefill(tmp_path, case, device):
    model = load_minivllm(case.write(tmp_path), device)
    c = model.config
    ids = random_token_ids(40, seed=3)
    full = minivllm_logits(model, ids)
    scale = float(full.abs().max())

    # one token at a time
    cache = ContiguousKVCache(c.n_layers, len(ids), c.n_kv_heads, c.head_dim, torch.float32, device)
    steps = torch.stack([model.forward(torch.tensor([tok], device=device), pos, cache)
                         for pos, tok in enumerate(ids)])
    err = float((steps - full).abs().max()) / scale
    assert err <= INCREMENTAL_RTOL, f"token-by-token: {err:.3g}"

    # uneven chunks (prefill then multi-token steps: the masked attention path)
    cache = ContiguousKVCache(c.n_layers, len(ids), c.n_kv_heads, c.head_dim, torch.float32, device)
    bounds = [0, 13, 14, 19, 27, 40]
    chunks = [model.forward(torch.tensor(ids[a:b], device=device), a, cache, all_logits=True)
              for a, b in zip(bounds, bounds[1:])]
    err = float((torch.cat(chunks) - full).abs().max()) / scale
    assert err <= INCREMENTAL_RTOL, f"chunked: {err:.3g}"


# --- error paths -----------------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
    path = write_tiny_model(tmp_path / "mamba.gguf", architecture_override="mamba")
    with pytest.raises(UnsupportedArchitectureError) as exc:
        ModelConfig.from_gguf(GGUFFile(path))
    assert exc.value.arch == "mamba"
    assert "'mamba'" in str(exc.value) and "llama" in str(exc.value)


def test_missing_tensor_is_named(tmp_path):
    path = write_tiny_model(tmp_path / "missing.gguf", omit=["blk.1.ffn_up.weight"])
    gf = GGUFFile(path)
    assert "blk.1.ffn_up.weight" not in gf.tensors and "blk.1.ffn_gate.weight" in gf.tensors
    with pytest.raises(MissingTensorError) as exc:
        load_model(gf, torch.device("cpu"), torch.float32, progress=False)
    assert exc.value.tensor == "blk.1.ffn_up.weight"
    assert "'blk.1.ffn_up.weight'" in str(exc.value)


def test_unsupported_weight_type_is_named(tmp_path):
    name = "blk.0.ffn_down.weight"
    path = write_tiny_model(tmp_path / "iq4nl.gguf", weight_type=T.Q8_0, type_overrides={name: T.IQ4_NL})
    gf = GGUFFile(path)
    assert gf.tensors[name].ggml_type == T.IQ4_NL and gf.tensors[name].shape == (256, 512)
    with pytest.raises(UnsupportedTensorTypeError) as exc:
        load_model(gf, torch.device("cpu"), torch.float32, progress=False)
    assert exc.value.tensor == name and exc.value.type_name == "IQ4_NL"
    assert name in str(exc.value) and "IQ4_NL" in str(exc.value)


# --- the helper itself -----------------------------------------------------------------------


def test_writer_is_deterministic(tmp_path):
    a = write_tiny_model(tmp_path / "a.gguf", weight_type=T.Q3_K, seed=5)
    b = write_tiny_model(tmp_path / "b.gguf", weight_type=T.Q3_K, seed=5)
    c = write_tiny_model(tmp_path / "c.gguf", weight_type=T.Q3_K, seed=6)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_tiny_vocab_tokenizes_like_transformers(refs):
    """The tiny byte-level BPE vocabulary is a working tokenizer: minivllm's vs the one
    transformers builds from the same GGUF metadata."""
    from transformers import AutoTokenizer

    from minivllm.gguf.tokenizer import Tokenizer

    path = refs(Case("qwen2", T.F16)).path
    ours = Tokenizer.from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    for text in ["the cat sat on the mat", "Hello, world! 123", "naïve café — ok"]:
        ids = ours.encode(text, add_bos=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert len(ours.encode("the cat sat on the mat", add_bos=False)) < len("the cat sat on the mat")


def test_weights_have_the_intended_spread(refs):
    """Sanity of the generator (not of minivllm): decoded k-quant weights are O(0.1) and
    roughly centred, so the logits comparisons above run on O(1) logits."""
    from gguf import GGUFReader
    from gguf import quants as gq

    for wtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        reader = GGUFReader(refs(Case("llama", wtype)).path)
        t = next(t for t in reader.tensors if t.name == "blk.0.ffn_gate.weight")
        w = gq.dequantize(t.data, t.tensor_type)
        assert 0.05 < w.std() < 0.12 and abs(w.mean()) < 0.3 * w.std(), (wtype.name, w.mean(), w.std())
        assert np.isfinite(w).all()
