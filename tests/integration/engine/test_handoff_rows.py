"""Handoff rows (EngineConfig.handoff_rows, issue 43): an engine whose slots are all taken
still runs the prefill half of a split request, which leaves after its first token.

Reference for the token: the same request alone in a fresh engine, in batch-invariant
mode, where a row's numbers do not depend on what shares its step.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA_DIR
from engine_invariants import free_equals_total

from minivllm import LLM, SamplingParams
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
FIRST = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def llm(request, small_gpu_model_path):
    """On the GPU in f16 with CUDA graphs: a step of slots plus handoff rows replays the
    graphs captured for `max_rows` (SmolLM2, or on an offline GPU machine the synthetic
    0.5B: the test compares two paths of the engine, not a reference)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dtype = "float32" if request.param == "cpu" else "float16"
    return LLM(str(small_gpu_model_path), device=request.param, dtype=dtype, max_model_len=256, progress=False)


def engine(llm, **options) -> LLMEngine:
    return LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=256, batch_invariant=True,
                                                             max_active_requests=2, **options))


def status(e: LLMEngine, rid: str) -> str:
    return next(r["status"] for q in e.snapshot()["queues"].values() if isinstance(q, list) for r in q
                if r["id"] == rid)


def step_and_say_if_queued_ahead(e: LLMEngine) -> bool:
    """One step; True when it also queued the next one (async scheduling, CUDA graphs).
    That queued step holds the same rows, so a row freed before it runs is taken one
    step later."""
    before = e.counters["steps_queued_ahead"]
    e.step()
    return e.counters["steps_queued_ahead"] > before


def steps_until_a_freed_row_is_planned(ahead: bool) -> int:
    return 2 if ahead else 1


def first_token_alone(llm, prompt_ids) -> int:
    e = engine(llm)
    rid = e.add_request(prompt_ids, FIRST)
    while not e.request_state(rid).output_ids:
        e.step()
    return e.request_state(rid).output_ids[0]


def test_a_full_engine_runs_a_handoff_in_its_handoff_row(llm):
    tok = llm.tokenizer
    e = engine(llm, handoff_rows=1)
    busy = [e.add_request(tok.encode(PROMPTS[i]), LONG) for i in (0, 1)]
    e.step()
    assert all(e.request_state(r).output_ids for r in busy)  # both slots decode
    queued = e.add_request(tok.encode(PROMPTS[2]), FIRST)
    prompt = tok.encode(PROMPTS[3])
    split_half = e.add_request(prompt, FIRST, handoff=True)
    late_half = e.add_request(tok.encode(PROMPTS[4]), FIRST, handoff=True)
    e.step()
    # The handoff took the one row beyond the slots; the plain request and the second handoff wait.
    assert e.request_state(split_half).output_ids == [first_token_alone(llm, prompt)]
    assert not e.request_state(queued).output_ids and not e.request_state(late_half).output_ids
    assert status(e, queued) == status(e, late_half) == "waiting"
    assert e.snapshot()["last_step"]["decode_rows"] == 2 and len(e.snapshot()["queues"]["running"]) == 3
    # Until it is exported, the handoff decodes beside the slots: one row more than max_active_requests.
    ahead = step_and_say_if_queued_ahead(e)
    assert e.snapshot()["last_step"]["decode_rows"] == 3 and len(e.request_state(split_half).output_ids) == 2
    e.release(split_half)  # exported: the serving worker lets it go, and its row is free again
    for _ in range(steps_until_a_freed_row_is_planned(ahead)):
        e.step()
    assert e.request_state(late_half).output_ids and not e.request_state(queued).output_ids
    for r in busy:
        e.abort(r)
    e.release(late_half)
    while e.has_unfinished():
        e.step()
    free_equals_total(e)  # every page back (on CUDA, but the graphs' scratch page)


def test_without_handoff_rows_a_handoff_waits_for_a_slot(llm):
    tok = llm.tokenizer
    e = engine(llm)
    busy = [e.add_request(tok.encode(PROMPTS[i]), LONG) for i in (0, 1)]
    e.step()
    half = e.add_request(tok.encode(PROMPTS[3]), FIRST, handoff=True)
    for _ in range(3):
        ahead = step_and_say_if_queued_ahead(e)
    assert not e.request_state(half).output_ids and status(e, half) == "waiting"
    e.abort(busy[0])
    for _ in range(steps_until_a_freed_row_is_planned(ahead)):
        e.step()
    assert e.request_state(half).output_ids


def test_handoff_rows_size_the_step_and_are_checked():
    config = EngineConfig(max_active_requests=3, handoff_rows=2)
    assert config.max_rows == 5 and EngineConfig().handoff_rows == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="handoff_rows"):
            EngineConfig(handoff_rows=bad)
