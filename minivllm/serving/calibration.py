"""A worker's start-up calibration: a few timed engine steps that give its rates.

Runs on the worker's own engine after warm-up, with random token ids (speed does not
depend on which ids) and greedy sampling with EOS ignored, so lengths are exact:

- prefill: one prompt of `prefill_tokens` tokens -> prompt tokens / summed step time;
- decode: `decode_steps` decode-only steps at batch 1 and at batch B (min(4,
  max_active_requests)), each request with a `prefill_tokens` context -> rows / step
  time, median over the steps;
- the context term: batch-1 decode again at a long context (`long_context`, at least 4x
  `prefill_tokens`, within half the model length) -> step seconds per extra context
  token (worker_rates.py says why), 0 where no longer context fits or it is not slower.

Afterwards the engine is left as a user would find it: the prefix cache emptied and the
counters zeroed, since neither warm-up nor calibration is traffic (warm-up resets too, so
a worker that skips calibration or reads a rates profile starts as clean).
"""

from __future__ import annotations

import random
import statistics

from minivllm.engine.engine import LLMEngine
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.worker_rates import WorkerRates


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    steps = []
    while engine.has_unfinished():
        engine.step()
        steps.append(dict(engine.last_step))
    for rid in rids:
        engine.pop_output(rid)
    return steps


def _random_prompt(rng: random.Random, engine: LLMEngine, n: int) -> list[int]:
    vocab = engine.model.config.vocab_size
    return [rng.randrange(100, max(101, min(vocab, 30000))) for _ in range(n)]


def warm_up(engine: LLMEngine) -> None:
    """First calls pay for allocator growth, Triton compiles and CUDA-graph capture."""
    rng = random.Random(1)
    _run(engine, [_random_prompt(rng, engine, 16)], max_tokens=4)
    batch = min(4, engine.config.max_active_requests)
    _run(engine, [_random_prompt(rng, engine, 8) for _ in range(batch)], max_tokens=4)
    _reset(engine)


def calibrate(engine: LLMEngine, *, prefill_tokens: int = 128, decode_steps: int = 8,
              long_context: int = 1024) -> WorkerRates:
    rng = random.Random(0)
    prefill_tokens = max(8, min(prefill_tokens, engine.max_model_len // 2, engine.config.max_batched_tokens * 4))
    steps = _run(engine, [_random_prompt(rng, engine, prefill_tokens)], max_tokens=1)
    prefill_time = sum(s["duration_s"] for s in steps if s["prefill_tokens"] > 0)
    prefill_tps = prefill_tokens / prefill_time if prefill_time > 0 else None

    decode_points: dict[int, float] = {}
    for batch in sorted({1, min(4, engine.config.max_active_requests)}):
        # Decode at a realistic context (prefill_tokens), not a toy one: attention over the
        # context is a real share of a CPU decode step.
        step_s = _decode_step_s(engine, [_random_prompt(rng, engine, prefill_tokens) for _ in range(batch)],
                                decode_steps)
        if step_s:
            decode_points[batch] = batch / step_s

    context_s = 0.0
    long_context = min(long_context, engine.max_model_len // 2)
    if 1 in decode_points and long_context >= 4 * prefill_tokens:
        long_s = _decode_step_s(engine, [_random_prompt(rng, engine, long_context)], decode_steps)
        if long_s:  # noise can make the long context look faster: that is no context cost
            context_s = max(0.0, (long_s - 1 / decode_points[1]) / (long_context - prefill_tokens))

    _reset(engine)
    return WorkerRates(prefill_tps=prefill_tps, decode_points=decode_points,
                       source="calibration" if prefill_tps and decode_points else "none",
                       context_s=context_s, calibration_context=prefill_tokens)


def _decode_step_s(engine: LLMEngine, prompts: list[list[int]], decode_steps: int) -> float | None:
    """Median seconds of the decode-only steps with every prompt decoding (None if none ran)."""
    steps = _run(engine, prompts, max_tokens=decode_steps + 1)
    times = [s["duration_s"] for s in steps
             if s["prefill_tokens"] == 0 and s["decode_rows"] == len(prompts) and s["duration_s"] > 0]
    return statistics.median(times) if times else None


def _reset(engine: LLMEngine) -> None:
    """Forget the synthetic requests: empty the prefix cache, zero the counters."""
    engine.reset_stats()
