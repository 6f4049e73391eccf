"""model/cpu_decode.py: the CPU layer loop without the Python between its kernels.

Reference: the decoder's general loop (MINIVLLM_CPU_LAYER_PLAN=0), which the other model
tests pin to transformers. The plan runs the same kernels in the same order, so every
logit of every step must be bit-identical, for a lone request and a batch, in float32 and
in the fast mode, on Llama (SmolLM2) and on Qwen2 (whose Q/K/V carry biases).
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kernels import cpu_gemv

needs_ext = pytest.mark.skipif(cpu_gemv.extension() is None, reason="no compiled CPU kernels: the plan never applies")


def _logits(path, dtype, monkeypatch, plan: str):
    monkeypatch.setenv("MINIVLLM_CPU_LAYER_PLAN", plan)
    llm = LLM(str(path), device="cpu", dtype=dtype, progress=False)
    seen = []
    llm.engine.logits_hook = lambda rid, logits: seen.append((rid, logits.clone()))
    outs = llm.generate(
        ["The quick brown fox", "Write a haiku about the sea"], SamplingParams(temperature=0.0, max_tokens=10)
    )
    ran = any(plan.ok for plan in getattr(llm.model, "_cpu_layer_plans", {}).values())
    return [o.token_ids for o in outs], seen, ran


@needs_ext
@pytest.mark.parametrize("model, dtype", [("smollm2", "float32"), ("smollm2", "bfloat16"), ("qwen05", "float32")])
def test_the_plan_is_bit_identical_to_the_general_loop(model, dtype, monkeypatch, smollm2_path, qwen05_path):
    path = smollm2_path if model == "smollm2" else qwen05_path
    tokens, fast, ran = _logits(path, dtype, monkeypatch, "1")
    ref_tokens, ref, ref_ran = _logits(path, dtype, monkeypatch, "0")
    assert ran and not ref_ran  # the plan served the first run only, so the comparison means something
    assert tokens == ref_tokens
    assert len(fast) == len(ref) == 20
    for (rid, a), (ref_rid, b) in zip(fast, ref):
        assert rid == ref_rid and torch.equal(a, b)


@needs_ext
def test_the_plan_steps_aside_where_it_does_not_apply(smollm2_path, monkeypatch):
    """Batch-invariant mode and rows past gemv_max_rows take the general loop (no GEMV plan
    for them): the call returns None, and generation still works."""
    from minivllm.model.cpu_decode import run_layers

    invariant = LLM(str(smollm2_path), device="cpu", dtype="float32", progress=False, batch_invariant=True)
    d_model = invariant.model.config.d_model
    assert run_layers(invariant.model, torch.zeros(1, d_model), None, None, None) is None
    assert invariant.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=3))[0].token_ids
    plain = LLM(str(smollm2_path), device="cpu", dtype="float32", progress=False)
    assert not plain.model.kernel_options.batch_invariant
    wide = torch.zeros(plain.model.kernel_options.gemv_max_rows + 1, d_model)
    assert run_layers(plain.model, wide, None, None, None) is None  # GEMM rows: the general loop
