"""Speculative decoding on an NVIDIA GPU (run on the device machine; skipped elsewhere).

References are independent of the speculative path: the same target model decoding
without a draft in batch-invariant mode, where each row's arithmetic does not depend on
the batch, the chunking or the number of query rows in a segment — so a verification
row of k + 1 tokens must score exactly what k + 1 separate decode steps would.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.cuda

PROMPTS = ["def quicksort(items):", "The capital of France is", "List three prime numbers:",
           "Once upon a time in a small village,"]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    rids = [engine.add_request(p, params) for p in prompts]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 5000
    return [engine.pop_output(r).token_ids for r in rids]


def draft_pages_free(engine: LLMEngine) -> bool:
    """Every draft page is free but the draft CUDA graphs' scratch page."""
    pool, graphs = engine.speculator.drafter.pool, engine.runner.draft.graphs
    return pool.num_free == pool.num_pages - (1 if graphs is not None else 0)


def perturbed_copy(path, device, dtype, noise: float):
    """The same file loaded again with noise added to its LM head: a draft that agrees
    with the target often but not always."""
    from minivllm.gguf.reader import GGUFFile
    from minivllm.model.loader import load_model

    draft = load_model(GGUFFile(path), device, dtype, progress=False)
    head = draft.output
    w = head.weight.dequantize(torch.float32)
    g = torch.Generator(device="cpu").manual_seed(0)
    noisy = w + noise * w.std() * torch.randn(w.shape, generator=g).to(w.device)
    head._dense = noisy.to(head.compute_dtype)  # GEMM reads the dense copy
    head._triton_ok = False  # and GEMV must too: the row-wise path over the same dense copy,
    head._repacked = None  # which the repacked kernel (the file's weights) would bypass
    return draft


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_greedy_speculation_matches_target_only_in_invariant_mode(smollm2_path, dtype):
    llm = LLM(str(smollm2_path), device="cuda", dtype=dtype, progress=False, max_model_len=256)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = dict(batch_invariant=True, max_active_requests=4, prefix_cache=False)
    want = run(LLMEngine(llm.model, llm.tokenizer, EngineConfig(**base)), prompts, params)
    draft = perturbed_copy(llm.model_path, llm.device, llm.dtype, noise=1.0)
    for policy in ("fixed:3", "acceptance-rate"):
        engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(**base, draft_policy=policy),
                           draft_model=draft, draft_tokenizer=llm.tokenizer)
        got = run(engine, prompts, params)
        stats = engine.snapshot()["speculative"]
        assert got == want, f"{policy}: speculative greedy output differs from target-only"
        assert stats["rounds"] > 0 and 0 < stats["accepted"] < stats["proposed"], stats
        assert draft_pages_free(engine)


def test_identical_draft_accepts_everything_with_cuda_graphs(small_gpu_model_path):
    llm = LLM(str(small_gpu_model_path), device="cuda", dtype="float16", progress=False, max_model_len=256)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(draft_policy="fixed:4", max_active_requests=4,
                                                              batch_invariant=True),
                       draft_model=llm.model, draft_tokenizer=llm.tokenizer)
    run(engine, prompts, params)
    s = engine.snapshot()["speculative"]
    assert s["acceptance_rate"] == 1.0 and s["bonus_tokens"] == s["rounds"], s
    assert engine.runner.draft.graphs is not None and engine.runner.draft.graphs.replays > 0


def test_sampled_rounds_and_abort_free_both_caches(smollm2_path):
    llm = LLM(str(smollm2_path), device="cuda", dtype="float16", progress=False, max_model_len=256)
    draft = perturbed_copy(llm.model_path, llm.device, llm.dtype, noise=0.5)
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(draft_policy="fixed:4", tv_budget=0.5,
                                                              max_active_requests=4, prefix_cache=False),
                       draft_model=draft, draft_tokenizer=llm.tokenizer)
    rids = [engine.add_request(llm.tokenizer.encode(p), SamplingParams(temperature=0.8, seed=i, max_tokens=200,
                                                                        ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    for _ in range(12):
        engine.step()
    s = engine.snapshot()["speculative"]
    assert s["rounds"] > 0 and s["tv_mean"] is not None and 0.0 <= s["tv_mean"] <= 1.0
    pool = engine.speculator.drafter.pool
    assert pool.num_free < pool.num_pages
    for r in rids:
        engine.abort(r)
    assert draft_pages_free(engine)
    scratch = 1 if engine.graph_runner is not None else 0
    assert engine.pool.num_free == engine.pool.num_pages - scratch
