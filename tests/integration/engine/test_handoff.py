"""A request split across two engines (engine/handoff.py): prefill and first tokens on A,
the rest on B, against one engine doing it all.

Reference: the same model in one engine, batch-invariant mode (a row's numbers do not
depend on its batch or chunking, and the imported pages hold exactly the bits B's own
prefill would have written), so the tokens must be equal one for one. Two engines over
one loaded model stand in for two CPU workers; what crosses is the Handoff (token ids,
plain K/V tensors, the RNG state), nothing shared.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA_DIR

from minivllm import LLM, SamplingParams
from minivllm.cache.kv_transfer import KVBlocks
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), device="cpu", dtype="float32", max_model_len=256, progress=False)


def engine(llm, **options) -> LLMEngine:
    return LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=256, batch_invariant=True, **options))


def whole(llm, prompt_ids, params) -> list[int]:
    e = engine(llm)
    rid = e.add_request(prompt_ids, params)
    while e.has_unfinished():
        e.step()
    return e.pop_output(rid).token_ids


def split(llm, prompt_ids, params, after: int, *, other=None):
    a, b = engine(llm), other or engine(llm)
    rid = a.add_request(prompt_ids, params)
    while len(a.request_state(rid).output_ids) < after:
        a.step()
    handoff = a.export_request(rid)
    first = a.request_state(rid).output_ids
    a.abort(rid)
    moved = handoff_through_bytes(handoff)
    rid_b = b.import_request(moved)
    while b.has_unfinished():
        b.step()
    out = b.pop_output(rid_b)
    return a, b, first, out, handoff


def handoff_through_bytes(handoff):
    """What a transport does: the tensors leave as bytes and come back as new tensors."""
    kv = handoff.kv
    moved = KVBlocks(list(kv.token_ids), torch.frombuffer(bytearray(kv.k.numpy().tobytes()), dtype=kv.k.dtype)
                     .reshape(kv.k.shape), torch.frombuffer(bytearray(kv.v.numpy().tobytes()), dtype=kv.v.dtype)
                     .reshape(kv.v.shape), kv.shape)
    return type(handoff)(handoff.prompt_ids, handoff.output_ids, handoff.params, moved,
                         handoff.generator_state.clone() if handoff.generator_state is not None else None,
                         handoff.generator_device)


@pytest.mark.parametrize("after", [1, 5])  # right after the prefill, and mid-decode
@pytest.mark.parametrize("sampled", [False, True])
def test_split_request_equals_the_whole_request(llm, after, sampled):
    prompt_ids = llm.tokenizer.encode(" ".join([PROMPTS[0], PROMPTS[1]]))
    params = (SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True) if sampled
              else SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    want = whole(llm, prompt_ids, params)
    a, b, first, out, handoff = split(llm, prompt_ids, params, after)
    assert first + out.token_ids == want
    ps = b.pool.page_size
    # B computed only the tail past the last full page: the rest came from A's pages.
    assert handoff.kv.n_tokens == (len(prompt_ids) + after - 1) // ps * ps > 0
    assert out.metrics.cached_prompt_tokens == handoff.kv.n_tokens
    for e in (a, b):  # nothing held but cached-idle pages
        snap = e.snapshot()["kv"]
        assert snap["available_pages"] == snap["total_pages"]


def test_imported_pages_already_cached_are_shared_not_copied(llm):
    prompt_ids = llm.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[3])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    b = engine(llm)
    whole_b = b.add_request(prompt_ids, params)  # B has computed (and cached) this prompt itself
    while b.has_unfinished():
        b.step()
    b.pop_output(whole_b)
    cached_before = b.snapshot()["prefix_cache"]["cached_pages"]
    _, _, first, out, handoff = split(llm, prompt_ids, params, 1, other=b)
    assert first + out.token_ids == whole(llm, prompt_ids, params)
    # Only the blocks past B's own cached prompt are new (the first token's page, if full).
    new_pages = b.snapshot()["prefix_cache"]["cached_pages"] - cached_before
    assert new_pages <= 1


def test_bad_handoffs_are_refused_by_name(llm):
    prompt_ids = llm.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = engine(llm)
    rid = a.add_request(prompt_ids, params)
    with pytest.raises(ConfigError, match="no token yet"):
        a.export_request(rid)
    while len(a.request_state(rid).output_ids) < 2:
        a.step()
    late = a.export_request(rid)
    late.params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ConfigError, match="leaves nothing"):
        engine(llm).import_request(late)
    while a.has_unfinished():
        a.step()
    with pytest.raises(ConfigError, match="has finished"):
        a.export_request(rid)
    a2 = engine(llm)
    rid2 = a2.add_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while len(a2.request_state(rid2).output_ids) < 1:
        a2.step()
    h = a2.export_request(rid2)
    h.kv.shape = (h.kv.shape[0] + 1, *h.kv.shape[1:])
    with pytest.raises(ConfigError, match="same model"):
        engine(llm).import_request(h)
    with pytest.raises(ConfigError, match="prefix_cache"):
        engine(llm, prefix_cache=False).import_request(a2.export_request(rid2))
