"""Async scheduling (engine/step_pipeline.py) against the same engine without it.

The pipelined path needs a replay that draws on the device and feeds the next replay
(CUDA graphs). On a CPU, `ReplayDouble` stands in for the graph runner with the same
contract and the same hazard: one logits buffer, overwritten by every replay, and the
next replay's input tokens taken from the last replay's argmax when none are given. The
forward inside it is the real model's. The reference is the same engine, same double,
with `async_scheduling=False`, in batch-invariant mode, so every token must match
exactly, whatever the batch; the CUDA path is checked the same way in
test_async_scheduling_cuda.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA_DIR

from minivllm import LLM, SamplingParams
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.step_inputs import Chunk, StepInputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]


class _Replayed:
    def __init__(self, logits: torch.Tensor, tokens: list[int]):
        self.logits, self.rows, self._tokens = logits, len(tokens), tokens

    def replace(self, row: int, token: torch.Tensor) -> None:
        self._tokens[row] = int(token)  # the double's next input too (the same list)

    def tokens(self) -> list[int]:
        return list(self._tokens)


class ReplayDouble:
    """The DecodeGraphRunner contract on a CPU: run(token_ids | None, segments)."""

    def __init__(self, engine: LLMEngine):
        runner = engine.runner
        self.model, self.options = runner.model, runner.options
        self.inputs = StepInputs(engine.pool, tokens=64, rows=16, invariant=runner.options.batch_invariant)
        self.scratch_page = engine.pool.allocate(1)[0]
        self.buffer = torch.full((16, engine.model.config.vocab_size), float("nan"))
        self.last_tokens: list[int] = []
        self.replays, self.fed = 0, 0
        self.buckets, self.graphs, self.failed = [16], {}, {}

    def can_run(self, segments) -> bool:
        return 0 < len(segments) <= 16 and all(s.n == 1 for s in segments)

    def run(self, token_ids, segments):
        if token_ids is None:
            assert len(self.last_tokens) == len(segments), "a fed replay must have the last replay's rows"
            token_ids = self.last_tokens
            self.fed += 1
        chunks = [Chunk([t], s.start, s.block_table) for t, s in zip(token_ids, segments, strict=True)]
        batch = self.inputs.fill(chunks, list(range(len(chunks))))
        logits = self.model.forward_batch(batch.token_ids, batch.positions, batch.kv, batch.logit_rows,
                                          options=self.options)
        n = len(segments)
        self.buffer[:n].copy_(logits)  # the next replay overwrites it, as a graph's output buffer
        self.last_tokens = self.buffer[:n].argmax(dim=-1).tolist()
        self.replays += 1
        return _Replayed(self.buffer[:n], self.last_tokens)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), device="cpu", dtype="float32", max_model_len=256, progress=False)


def make(llm, **options) -> tuple[LLMEngine, ReplayDouble]:
    engine = LLMEngine(llm.model, llm.tokenizer,
                       EngineConfig(max_model_len=256, batch_invariant=True, prefix_cache=False, **options))
    double = engine.runner.graphs = ReplayDouble(engine)
    return engine, double


def drive(engine, requests, *, between=None) -> dict:
    """Run to completion; `between(step_index, engine, ids)` may add or abort requests."""
    ids = [engine.add_request(engine.tokenizer.encode(p), params) for p, params in requests]
    k = 0
    while engine.has_unfinished():
        engine.step()
        k += 1
        if between is not None:
            between(k, engine, ids)
    outs = {}
    for rid in engine.request_ids():
        out = engine.pop_output(rid)
        outs[rid] = (out.token_ids, out.finish_reason, out.text)
    return outs


def free_pages(engine, double) -> bool:
    snap = engine.snapshot()["kv"]
    return snap["available_pages"] == snap["total_pages"] - 1  # the double's scratch page


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_pipelined_steps_give_the_same_tokens(llm):
    requests = [(PROMPTS[0], greedy(5)), (PROMPTS[1], greedy(12, stop=[" the"])), (PROMPTS[2], greedy(20)),
                (PROMPTS[3], greedy(16, ignore_eos=True))]
    engine, double = make(llm)
    got = drive(engine, requests)
    ref_engine, _ = make(llm, async_scheduling=False)
    want = drive(ref_engine, requests)
    assert list(got.values()) == list(want.values())
    assert engine.counters["steps_queued_ahead"] > 10 and double.fed == engine.counters["steps_queued_ahead"]
    assert ref_engine.counters["steps_queued_ahead"] == 0
    # Rows ended by their limit, a stop string and max_tokens 5 all left their pages.
    assert free_pages(engine, double) and engine._ahead is None


def test_abort_and_arrival_while_a_step_is_queued_ahead(llm):
    requests = [(PROMPTS[i], greedy(30, ignore_eos=True)) for i in range(3)]
    late = (PROMPTS[4], greedy(10, ignore_eos=True))
    seen = {}

    def between(k, engine, ids):
        if k == 6:
            seen[engine.config.async_scheduling] = engine._ahead is not None
            engine.abort(ids[1])
        if k == 9:
            engine.add_request(engine.tokenizer.encode(late[0]), late[1], request_id="late")

    engine, double = make(llm)
    got = drive(engine, requests, between=between)
    ref, _ = make(llm, async_scheduling=False)
    want = drive(ref, requests, between=between)
    assert seen[True] and not seen[False]  # the abort really hit a step already queued
    assert got == want
    assert got["late"][1] == "length" and len(got["late"][0]) == 10
    assert free_pages(engine, double)


def test_seeded_sampled_rows_are_drawn_on_the_device_with_the_same_tokens(llm):
    requests = [(PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=14, ignore_eos=True)),
                (PROMPTS[1], greedy(14, ignore_eos=True)),
                (PROMPTS[2], SamplingParams(temperature=1.3, top_k=20, min_p=0.05, seed=11, max_tokens=10))]
    engine, double = make(llm)
    got = drive(engine, requests)
    ref, _ = make(llm, async_scheduling=False)
    assert got == drive(ref, requests)
    assert engine.counters["steps_queued_ahead"] > 5 and free_pages(engine, double)


def test_a_full_engine_with_a_queue_keeps_pipelining(llm):
    # Three requests for two slots: the third waits, and the two running still pipeline.
    requests = [(PROMPTS[i], greedy(10 + 4 * i, ignore_eos=True)) for i in range(3)]
    engine, double = make(llm, max_active_requests=2)
    seen = []
    got = drive(engine, requests, between=lambda k, e, ids: seen.append((len(e._scheduler.waiting),
                                                                         e._ahead is not None)))
    ref, _ = make(llm, max_active_requests=2, async_scheduling=False)
    assert got == drive(ref, requests)
    assert any(waiting and ahead for waiting, ahead in seen)
    assert free_pages(engine, double)


def test_rows_that_need_their_logits_are_never_queued_ahead(llm):
    sampled_with_penalty = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True,
                                          presence_penalty=0.5)
    with_logprobs = greedy(12, ignore_eos=True, logprobs=2)
    penalised = greedy(12, ignore_eos=True, repetition_penalty=1.3)
    for params in (sampled_with_penalty, with_logprobs, penalised):
        requests = [(PROMPTS[0], greedy(12, ignore_eos=True)), (PROMPTS[1], params)]
        engine, _ = make(llm)
        got = drive(engine, requests)
        ref, _ = make(llm, async_scheduling=False)
        assert got == drive(ref, requests)
        assert engine.counters["steps_queued_ahead"] == 0


def test_a_logits_hook_turns_it_off(llm):
    engine, _ = make(llm)
    engine.logits_hook = lambda rid, logits: None
    drive(engine, [(PROMPTS[0], greedy(8, ignore_eos=True))])
    assert engine.counters["steps_queued_ahead"] == 0
