"""The model runner (engine/model_runner.py) and the step's three calls.

References, per test:

* decode inputs: a torch function mode counts every `torch.tensor` / `torch.as_tensor`
  call made from Python data while decode steps run (the count a per-step
  `torch.tensor(ids)` design makes is several per step); the mode is first shown to see
  such a call;
* kernel options per call: each fork of one model run alone (logits through the logits
  hook, compared with torch.equal), against the same forks stepping alternately and in
  two threads at once; the model's own default forward, computed before any engine ran;
* the runner changes no request: the request's fields before and after `execute`.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from minivllm import LLM, SamplingParams
from minivllm.spec.perturbed_draft import perturbed_copy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["The quick brown fox", "Write a haiku about the sea", "def add(a, b):"]


class ListTensorCounter(TorchFunctionMode):
    """Counts tensors made from Python data (lists, tuples, numbers) by torch.tensor / as_tensor."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.tensor, torch.as_tensor) and args and not isinstance(args[0], torch.Tensor):
            self.calls.append(f"{func.__name__}({str(args[0])[:40]})")
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), device="cpu", dtype="float32", progress=False, max_model_len=256)


def _decode_calls(engine, steps: int = 5) -> list[str]:
    """Submit PROMPTS, step until every request decodes, then count over `steps` decode steps."""
    rids = [engine.add_request(engine.tokenizer.encode(p), SamplingParams(temperature=0.0, max_tokens=40,
                                                                          ignore_eos=True)) for p in PROMPTS]
    while any(engine.request_state(r).phase != "decode" for r in rids):
        engine.step()
    with ListTensorCounter() as counter:
        for _ in range(steps):
            engine.step()
            assert engine.last_step["decode_rows"] == len(PROMPTS) and engine.last_step["prefill_tokens"] == 0
    for r in rids:
        engine.release(r)
    return counter.calls


def test_the_counter_sees_a_tensor_made_from_a_list():
    with ListTensorCounter() as counter:
        torch.tensor([1, 2, 3])
        torch.as_tensor((4,))
        torch.zeros(3)
    assert len(counter.calls) == 2, counter.calls


def test_decode_steps_make_no_tensor_from_python_lists(llm):
    assert _decode_calls(llm.engine) == []
    assert _decode_calls(llm.fork(gemv_max_rows=0).engine) == []  # the GEMM path too


def test_speculative_decode_steps_make_no_tensor_from_python_lists(llm, smollm2_path):
    from minivllm.engine.engine import LLMEngine
    from minivllm.engine.engine_config import EngineConfig

    draft = perturbed_copy(smollm2_path, noise=0.5, seed=1)
    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=256, draft_policy="fixed:3"),
                       draft_model=draft, draft_tokenizer=llm.tokenizer)
    assert _decode_calls(engine) == []
    assert engine.snapshot()["speculative"]["rounds"] > 0  # the steps counted verified proposals


# -- kernel options per call ----------------------------------------------------------------------


def _logits_run(llms, params, *, interleave: bool) -> list[list[tuple[str, torch.Tensor]]]:
    """Each LLM's hooked logits for PROMPTS: the engines run one after the other, or
    stepping in turn (one step of each, round robin)."""
    seen = [[] for _ in llms]
    for i, other in enumerate(llms):
        other.engine.logits_hook = lambda rid, logits, i=i: seen[i].append((rid, logits.clone()))
        for p in PROMPTS:
            other.engine.add_request(other.tokenizer.encode(p), params, request_id=p)
    if interleave:
        while any(o.engine.has_unfinished() for o in llms):
            for o in llms:
                if o.engine.has_unfinished():
                    o.engine.step()
    else:
        for o in llms:
            for _ in o.engine.run():
                pass
    for o in llms:
        o.engine.logits_hook = None
        for p in PROMPTS:
            o.engine.release(p)
    return seen


def _same(a, b) -> bool:
    return len(a) == len(b) and all(ra == rb and torch.equal(la, lb) for (ra, la), (rb, lb) in zip(a, b, strict=True))


def test_forks_stepping_in_turn_give_the_bits_each_gives_alone(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    row = llm.tokenizer.encode(PROMPTS[0])
    before = llm.model.forward(torch.tensor(row), 0, _cache(llm, len(row)))
    assert llm.model.kernel_options.gemv_max_rows == 8  # the CPU default: the model's forward takes the GEMV
    gemv, gemm = llm.fork(gemv_max_rows=8), llm.fork(gemv_max_rows=0)
    alone = [_logits_run([gemv], params, interleave=False)[0], _logits_run([gemm], params, interleave=False)[0]]
    # The two option sets take different kernels whose logits differ in their bits, so a
    # fork running under the other's options would show.
    assert not _same(alone[0], alone[1])
    assert all(_same(a, b) for a, b in zip(alone, _logits_run([gemv, gemm], params, interleave=True), strict=True))
    # Nothing an engine ran changed the model's own defaults (the GEMM fork stepped last).
    assert torch.equal(llm.model.forward(torch.tensor(row), 0, _cache(llm, len(row))), before)


def test_forks_in_two_threads_give_the_bits_each_gives_alone(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    forks = [llm.fork(gemv_max_rows=0), llm.fork(gemv_max_rows=8)]
    alone = [_logits_run([f], params, interleave=False)[0] for f in forks]
    together: list = [None, None]
    start = threading.Barrier(2)

    def run(i):
        start.wait()
        together[i] = _logits_run([forks[i]], params, interleave=False)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(_same(a, b) for a, b in zip(alone, together, strict=True))


def _cache(llm, n: int):
    from minivllm.cache.contiguous import ContiguousKVCache

    c = llm.model.config
    return ContiguousKVCache(c.n_layers, n, c.n_kv_heads, c.head_dim, dtype=llm.model.dtype, device=llm.model.device)


# -- the runner changes no request ----------------------------------------------------------------------


def test_execute_changes_no_request_and_update_applies_the_output(llm):
    engine = llm.fork().engine
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4)
    rids = [engine.add_request(engine.tokenizer.encode(p), params) for p in PROMPTS]
    scheduler = engine._scheduler
    for _ in range(3):
        plan = scheduler.schedule()
        fields = [(r.request.status, list(r.request.output_ids), r.request.num_computed, list(r.request.block_table),
                   r.request.text, r.request.finish_reason) for r in plan.rows]
        output = engine.runner.execute(plan)
        assert fields == [(r.request.status, list(r.request.output_ids), r.request.num_computed,
                           list(r.request.block_table), r.request.text, r.request.finish_reason) for r in plan.rows]
        drawn = {rid: row.tokens for rid, row in output.rows.items()}
        scheduler.update(plan, output)
        for row in plan.rows:
            if row.needs_logits:
                assert row.request.output_ids[-1:] == drawn[row.request.id]
    for r in rids:
        engine.release(r)
