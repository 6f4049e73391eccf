"""The device's view of a batch-16 decode step, constrained or not: where the GPU waits.

The bench's setup (`minivllm bench structured`): the synthetic Qwen2.5-0.5B, greedy rows of
64 tokens, unconstrained or under the bench's JSON schemas. Nothing is synchronized: CUDA
events recorded at five points of every decode step (its start, around the forward's
graph replay, after the draw, at its end) give GPU timestamps. Where the GPU is idle an
event completes when the host reaches it, so an interval between two events is the
longer of the host's time and the device's. Printed per decode step (ms): the whole
step's median, mean (what throughput follows) and 90th percentile, then each interval's
mean:

    outside   from the last step's end to this one's start (the generate loop)
    prepare   schedule, inputs, up to the graph replay
    forward   the graph replay: the model's device time
    draw      from the forward's end to the draw's: masks applied, argmax, the host's checks
    append    the tokens appended (constraint advance, stop strings, events)

Usage on a GPU box:
    python scripts/structured_step_timeline.py QWEN25_TOKENIZER_FIELDS
"""

import statistics
import sys

import torch

from minivllm.bench.structured_cost import FREE_SCHEMA, LONG_SCHEMA, row_schema
from minivllm.bench.synthetic_model import ensure_synthetic_model
from minivllm.engine import engine as engine_module
from minivllm.engine.cuda_graphs import DecodeGraphRunner
from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams

path = ensure_synthetic_model("qwen2.5-0.5b-q4_k_m", tokenizer_source=sys.argv[1])
llm = LLM(str(path), device="cuda", dtype="float16", progress=False, max_model_len=192,
          prefix_cache=False, max_active_requests=16)
steps: list[dict[str, torch.cuda.Event]] = []


def mark(name: str) -> None:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    steps[-1][name] = event


def wrap(owner, attr: str, before: str | None, after: str | None, new_step: bool = False) -> None:
    real = getattr(owner, attr)

    def wrapper(*args, **kwargs):
        if new_step:
            steps.append({})
        if before:
            mark(before)
        out = real(*args, **kwargs)
        if after:
            mark(after)
        return out

    setattr(owner, attr, wrapper)


wrap(engine_module.LLMEngine, "_step", "start", "end", new_step=True)
wrap(DecodeGraphRunner, "run", "replay", "forward_done")
wrap(engine_module.LLMEngine, "_draw", None, "draw_done")


def batch(schema, round_no: int) -> None:
    """`schema`: None (unconstrained), one schema for every row, or a function of the row."""
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                             structured={"json_schema": schema(i) if callable(schema) else schema} if schema else None)
              for i in range(16)]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Request {round_no}-{i}: JSON."}])
               for i in range(16)]
    llm.generate(prompts, params)


for r in range(2):  # warm-up: CUDA graphs, llguidance's vocabulary
    for schema in (None, LONG_SCHEMA, FREE_SCHEMA, row_schema):
        batch(schema, r)
INTERVALS = (("outside", "end_prev", "start"), ("prepare", "start", "replay"), ("forward", "replay", "forward_done"),
             ("draw", "forward_done", "draw_done"), ("append", "draw_done", "end"))
for label, schema in (("unconstrained", None), ("bounded strings", LONG_SCHEMA), ("free strings", FREE_SCHEMA),
                      ("own schema per row", row_schema)):
    steps.clear()
    for r in range(3):
        batch(schema, 10 + r)
    torch.cuda.synchronize()
    for prev, step in zip(steps, steps[1:]):
        step["end_prev"] = prev["end"]
    decode = [s for s in steps[1:] if "replay" in s and "end_prev" in s]
    times = {name: [s[b0].elapsed_time(s[b1]) for s in decode] for name, b0, b1 in INTERVALS}
    whole = [sum(t[k] for t in times.values()) for k in range(len(decode))]
    print(f"{label:16s} {len(decode)} decode steps: median {statistics.median(whole):.3f}, "
          f"mean {statistics.fmean(whole):.3f}, p90 {statistics.quantiles(whole, n=10)[-1]:.3f} ms; means: "
          + "  ".join(f"{name} {statistics.fmean(v):.3f}" for name, v in times.items()))
    slowest = sorted(range(len(decode)), key=lambda k: -whole[k])[:6]
    print("  slowest (step of its batch: intervals):", "; ".join(
        f"{k % (len(decode) // 3)}: " + " ".join(f"{times[name][k]:.2f}" for name, _, _ in INTERVALS) for k in slowest))
