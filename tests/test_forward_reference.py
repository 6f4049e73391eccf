"""Logits and greedy continuations against an independent implementation.

The reference is Hugging Face transformers loading the *same* GGUF file with
`gguf_file=` in float32: it dequantizes with the gguf package's numpy code and runs
its own Llama/Qwen2 modules (un-permuting llama Q/K itself), so it shares no code with
minivllm's reader, dequantizer, RoPE, attention or MLP.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DATA_DIR
from minivllm import LLM, SamplingParams

PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]


def _transformers_model(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True).eval()


def _max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module", params=["smollm2", "qwen05"])
def pair(request, smollm2_path, qwen05_path):
    path = smollm2_path if request.param == "smollm2" else qwen05_path
    # The default kernels: float32 means float32 on every path (decode rows take the f32
    # GEMV of cpu_gemv.cpp, prompts the f32 GEMM), so the defaults are what this file pins.
    llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
    ref = _transformers_model(path)
    yield request.param, llm, ref
    del llm, ref


def test_logits_match_transformers_f32(pair):
    name, llm, ref = pair
    from minivllm.cache.contiguous import ContiguousKVCache

    cfg = llm.config
    worst = 0.0
    for prompt in PROMPTS[:6]:
        ids = llm.tokenizer.encode(prompt)
        cache = ContiguousKVCache(cfg.n_layers, len(ids), cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
        ours = llm.model.forward(torch.tensor(ids), 0, cache, all_logits=True)
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].float()
        assert ours.shape == theirs.shape
        worst = max(worst, _max_rel_error(ours, theirs))
    assert worst <= 1e-4, f"{name}: max relative logit error {worst:.2e} > 1e-4"


def test_greedy_continuations_match_transformers(pair):
    name, llm, ref = pair
    n_new = 20
    for prompt in PROMPTS[:4]:
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True))[0]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            theirs = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
                                  min_new_tokens=n_new, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out.token_ids == theirs, f"{name}: greedy continuation of {prompt!r} differs"


def test_incremental_decode_matches_full_prefill(pair):
    """Decoding one token at a time through the KV cache gives the logits of one big prefill."""
    _, llm, _ = pair
    from minivllm.cache.contiguous import ContiguousKVCache

    cfg = llm.config
    ids = llm.tokenizer.encode(PROMPTS[0])
    full_cache = ContiguousKVCache(cfg.n_layers, len(ids), cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
    full = llm.model.forward(torch.tensor(ids), 0, full_cache, all_logits=True)
    cache = ContiguousKVCache(cfg.n_layers, len(ids), cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
    llm.model.forward(torch.tensor(ids[:4]), 0, cache)
    for pos in range(4, len(ids)):
        step = llm.model.forward(torch.tensor([ids[pos]]), pos, cache)
        # Decode attends with two grouped bmm calls, prefill with SDPA: only float32
        # summation order differs (measured up to 2e-5 on Qwen's 24 layers); a wrong
        # position or cache slot moves logits by > 1e-2.
        assert _max_rel_error(step, full[pos]) <= 1e-4


@pytest.mark.cuda
@pytest.mark.parametrize("model", ["smollm2", "qwen05"])
def test_cuda_logits_and_greedy_match_transformers(model, smollm2_path, qwen05_path):
    """The same comparisons with minivllm on the GPU (transformers stays on the CPU)."""
    from conftest import cuda_devices
    from minivllm.cache.contiguous import ContiguousKVCache

    path = smollm2_path if model == "smollm2" else qwen05_path
    dev = cuda_devices()[0]
    llm = LLM(str(path), device=dev, dtype="float32", progress=False, gemv_max_rows=0)
    ref = _transformers_model(path)
    cfg = llm.config
    for prompt in PROMPTS[:4]:
        ids = llm.tokenizer.encode(prompt)
        cache = ContiguousKVCache(cfg.n_layers, len(ids), cfg.n_kv_heads, cfg.head_dim, torch.float32, dev)
        ours = llm.model.forward(torch.tensor(ids, device=dev), 0, cache, all_logits=True).cpu()
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).logits[0].float()
        assert _max_rel_error(ours, theirs) <= 1e-4
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
        with torch.no_grad():
            t = torch.tensor([ids])
            greedy = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == greedy
