"""The TV-budget lesson of notebooks/speculative.ipynb, on real weights: with a draft that
differs from its target (a perturbed copy of SmolLM2, `spec.perturbed_draft`), the three
budgets of mentored decoding accept different shares of the draft's tokens.

The acceptance probability is min(1, pi(x)/q(x)) with pi = p (D = 0, lossless), a mixture
within D of p (D = 0.5), or q itself (D = 1, every token accepted), so the rates must rise
with D and reach 1 at D = 1.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.spec.perturbed_draft import perturbed_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_perturbed_copy_changes_the_draft_only(smollm2_path):
    llm = LLM(str(smollm2_path), max_model_len=128, progress=False)
    before = llm.model.output_norm.clone()
    draft = perturbed_copy(smollm2_path, noise=0.3)
    assert draft is not llm.model and torch.equal(llm.model.output_norm, before)
    assert not torch.equal(draft.output_norm, before)
    with pytest.raises(ValueError, match="noise"):
        perturbed_copy(smollm2_path, noise=-1.0)


def test_three_tv_budgets_give_three_acceptance_rates(smollm2_path):
    llm = LLM(str(smollm2_path), max_model_len=256, progress=False)
    draft = perturbed_copy(smollm2_path, noise=0.3, seed=0)
    prompt = llm.tokenizer.encode(llm.chat_prompt([{"role": "user", "content":
                                                    "Write a Python function is_prime(n). Only the code."}]))
    rates = {}
    for budget in (0.0, 0.5, 1.0):
        engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=256, max_active_requests=2,
                                                                  tv_budget=budget),
                           draft_model=draft, draft_tokenizer=llm.tokenizer)
        rid = engine.add_request(prompt, SamplingParams(temperature=0.7, seed=1, max_tokens=48, ignore_eos=True))
        while engine.request_state(rid).finish_reason is None:
            engine.step()
        spec = engine.pop_output(rid).metrics.speculation
        assert spec["proposed"] >= 24, spec
        rates[budget] = spec["acceptance_rate"]
    assert rates[0.0] < rates[0.5] < rates[1.0] == 1.0, rates
    assert rates[0.5] - rates[0.0] > 0.05, rates  # a visible difference, not rounding
