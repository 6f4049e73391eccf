"""Async scheduling on a GPU: the CUDA graph feeds the next replay its own argmax.

Reference: the same engine with `async_scheduling=False` (every step's tokens read
before the next is planned). Both run the same captured graphs with the same inputs, so
the tokens must be identical, in batch-invariant mode and in the default one. The model:
conftest's `small_gpu_model_path` (SmolLM2, or a synthetic file on an offline GPU box).
"""

from __future__ import annotations

import json

import pytest
from conftest import DATA_DIR

from minivllm import LLM, SamplingParams
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig

pytestmark = pytest.mark.cuda
PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]


@pytest.fixture(scope="module")
def llm(small_gpu_model_path):
    return LLM(str(small_gpu_model_path), device="cuda", dtype="float16", max_model_len=256, progress=False)


def run(llm, requests, *, abort_at: int | None = None, **options):
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=256, prefix_cache=False, **options))
    ids = [engine.add_request(llm.tokenizer.encode(p), params) for p, params in requests]
    k, ahead_at_abort = 0, None
    while engine.has_unfinished():
        engine.step()
        k += 1
        if k == abort_at:
            ahead_at_abort = engine.counters["steps_queued_ahead"] > 0
            engine.abort(ids[0])
    outs = {rid: engine.pop_output(rid) for rid in ids}
    snap = engine.snapshot()
    assert snap["kv"]["available_pages"] == snap["kv"]["total_pages"] - 1, "pages left held"
    return engine, {rid: (o.token_ids, o.finish_reason) for rid, o in outs.items()}, ahead_at_abort


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("n", [1, 5])
def test_async_steps_give_the_tokens_of_sync_steps(llm, n, invariant):
    requests = [(PROMPTS[i], greedy(6 + 7 * i, ignore_eos=i % 2 == 0)) for i in range(n)]
    engine, got, _ = run(llm, requests, batch_invariant=invariant)
    ref, want, _ = run(llm, requests, batch_invariant=invariant, async_scheduling=False)
    assert got == want
    assert engine.counters["steps_queued_ahead"] > 0 and ref.counters["steps_queued_ahead"] == 0


def test_seeded_sampled_rows_drawn_on_the_device(llm):
    requests = [(PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True)),
                (PROMPTS[1], greedy(20, ignore_eos=True)),
                (PROMPTS[2], SamplingParams(temperature=1.2, top_k=40, seed=5, max_tokens=16, ignore_eos=True))]
    engine, got, _ = run(llm, requests, batch_invariant=True)
    _, want, _ = run(llm, requests, batch_invariant=True, async_scheduling=False)
    assert got == want and engine.counters["steps_queued_ahead"] > 0


def test_abort_of_a_row_in_a_step_queued_ahead(llm):
    requests = [(PROMPTS[i], greedy(24, ignore_eos=True)) for i in range(3)]
    _, got, ahead = run(llm, requests, abort_at=8)
    _, want, _ = run(llm, requests, abort_at=8, async_scheduling=False)
    assert ahead and got == want
