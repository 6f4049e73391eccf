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
from conftest import DATA_DIR, transformers_greedy

from minivllm import LLM, SamplingParams

PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]


def _transformers_model(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True).eval()


def _max_rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# What test_logits_match_transformers_f32 pins: every prefill logit within LOGITS_RTOL *
# max |logit| of transformers'; test_incremental_decode_matches_full_prefill holds decode
# steps to the same bound against the prefill, so a generated token's logits are within
# DECODE_RTOL of transformers'. Two logits each that far off can swap order only where
# transformers' top-1/top-2 margin is below twice that, so greedy tokens are compared up to
# the first such near-tie, not beyond: the two implementations sum in different orders, and
# which side of a near-tie each lands on is a fact about the CPU's kernels, not the code.
LOGITS_RTOL = 1e-4
DECODE_RTOL = 2 * LOGITS_RTOL


def _check_greedy_up_to_near_tie(ours: list[int], theirs: list[int], margins: list[float], scales: list[float],
                                 label: str) -> int:
    """ours == theirs up to transformers' first near-tie (margin <= 2 * DECODE_RTOL * max
    |logit|); returns how many tokens that compared."""
    n_sure = next((i for i, (m, s) in enumerate(zip(margins, scales)) if m <= 2 * DECODE_RTOL * s), len(theirs))
    assert ours[:n_sure] == theirs[:n_sure], (
        f"{label}: greedy continuation differs before transformers' first near-tie (token {n_sure}): "
        f"{ours} vs {theirs}; margins {[f'{m:.2e}' for m in margins[:n_sure + 1]]}")
    return n_sure


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
    assert worst <= LOGITS_RTOL, f"{name}: max relative logit error {worst:.2e} > {LOGITS_RTOL}"


def test_greedy_continuations_match_transformers(pair):
    name, llm, ref = pair
    n_new = 20
    compared = 0
    for prompt in PROMPTS[:4]:
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True))[0]
        theirs, margins, scales = transformers_greedy(ref, out.prompt_token_ids, n_new)
        compared += _check_greedy_up_to_near_tie(out.token_ids, theirs, margins, scales, f"{name} {prompt!r}")
    # Not vacuous: near-ties that close are rare, so most tokens were compared.
    assert compared >= 4 * n_new // 2, f"{name}: only {compared} of {4 * n_new} tokens before a near-tie"


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
        assert _max_rel_error(step, full[pos]) <= LOGITS_RTOL


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
        assert _max_rel_error(ours, theirs) <= LOGITS_RTOL
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
        greedy, margins, scales = transformers_greedy(ref, ids, 16)
        _check_greedy_up_to_near_tie(out.token_ids, greedy, margins, scales, f"{model} on {dev} {prompt!r}")
