"""Where a constrained batch-16 decode step spends its time, next to an unconstrained one.

The bench's setup (`minivllm bench structured`): the synthetic Qwen2.5-0.5B, greedy rows
of 64 tokens under the bench's JSON schema (length-bounded strings, or free ones). The
step is cut into phases timed with perf_counter, and the forward is followed by a device
synchronize in the timed runs, so the GPU time lands in "forward" and not in whichever
phase first waits for it. Those runs are therefore slower than the bench's; the phases
say where the constrained step's extra time goes. Each is preceded by an unsynchronized
run, timed as the bench times it, with the host's waits for the device (`tolist`). Add
`--cprofile` for the main thread's cProfile. Usage on a GPU box:
    python scripts/profile_structured_step.py QWEN25_TOKENIZER_FIELDS [--cprofile]
"""

import collections
import cProfile
import pstats
import sys
import time

import torch

from minivllm.bench.structured_cost import FREE_SCHEMA, LONG_SCHEMA
from minivllm.bench.synthetic_model import ensure_synthetic_model
from minivllm.engine import engine as engine_module
from minivllm.engine.cuda_graphs import DecodeGraphRunner
from minivllm.engine.llm import LLM
from minivllm.sampling import constraint as constraint_module
from minivllm.sampling import step_draw
from minivllm.sampling.sampling_params import SamplingParams

path = ensure_synthetic_model("qwen2.5-0.5b-q4_k_m", tokenizer_source=sys.argv[1])
llm = LLM(str(path), device="cuda", dtype="float16", progress=False, max_model_len=192,
          prefix_cache=False, max_active_requests=16)
phases: dict[str, float] = collections.defaultdict(float)
synchronize = {"forward": True}  # off for the bench-like timing of whole steps


def timed(owner, name: str, phase: str, sync: bool = False):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        if sync and synchronize["forward"]:
            torch.cuda.synchronize()
        phases[phase] += time.perf_counter() - t0
        return out

    setattr(owner, name, wrapper)


timed(engine_module.LLMEngine, "_step", "step")
timed(DecodeGraphRunner, "run", "forward (graph replay + device time)", sync=True)
timed(constraint_module.Constraints, "early_masks", "masks beside the forward (early_masks)")
timed(engine_module.LLMEngine, "_draw", "draw (step_draw)")
timed(engine_module.LLMEngine, "_append_token", "append tokens (constraint advance, stops)")
timed(constraint_module.TokenConstraint, "fill", "  of which: llguidance masks")
timed(constraint_module.TokenConstraint, "allows", "  of which: candidate checks")
timed(step_draw, "launch_greedy_candidates", "  of which: candidates' top-k launch")
timed(step_draw, "read_greedy_candidates", "  of which: candidates' copy back (when an argmax is forbidden)")
timed(constraint_module.Constraints, "apply", "  of which: applying the masks (stack, copy, launch)")
timed(step_draw, "penalized", "  of which: the final argmax's stack")


def batch(schema, round_no: int) -> int:
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                             structured={"json_schema": schema} if schema else None) for _ in range(16)]
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"Request {round_no}-{i}: JSON."}])
               for i in range(16)]
    steps0 = llm.engine.counters["steps"]
    llm.generate(prompts, params)
    return llm.engine.counters["steps"] - steps0


for r in range(2):  # warm-up: CUDA graphs, llguidance's vocabulary
    for schema in (None, LONG_SCHEMA, FREE_SCHEMA):
        batch(schema, r)
real_tolist = torch.Tensor.tolist


def timed_tolist(self):
    t0 = time.perf_counter()
    out = real_tolist(self)
    phases["host waiting on the device (tolist)"] += time.perf_counter() - t0
    return out


for label, schema in (("unconstrained", None), ("bounded strings", LONG_SCHEMA), ("free strings", FREE_SCHEMA)):
    # As the bench runs it first: nothing synchronized, so "step" is the real step time.
    phases.clear()
    synchronize["forward"] = False
    torch.Tensor.tolist = timed_tolist
    steps = sum(batch(schema, 30 + r) for r in range(3))
    torch.Tensor.tolist = real_tolist
    synchronize["forward"] = True
    print(f"\n--- {label}, unsynchronized: {phases['step'] / steps * 1e3:.3f} ms/step; "
          + ", ".join(f"{k} {v / steps * 1e3:.3f}" for k, v in phases.items() if k != "step" and not k.startswith(" ")))
    phases.clear()
    counts = dict(llm.engine.constraints.counts)
    steps = sum(batch(schema, 10 + r) for r in range(3))
    step = phases["step"]
    print(f"\n=== {label}: {steps} steps, {step / steps * 1e3:.3f} ms/step with the forward synchronized")
    print("draws:", {k: v - counts[k] for k, v in llm.engine.constraints.counts.items()})
    accounted = 0.0
    for phase, total in phases.items():
        if phase != "step":
            print(f"  {phase:48s} {total / steps * 1e3:7.3f} ms/step")
            accounted += 0 if phase.startswith("  ") else total
    print(f"  {'rest of the step (schedule, inputs, events)':48s} {(step - accounted) / steps * 1e3:7.3f} ms/step")
    if "--cprofile" in sys.argv:
        prof = cProfile.Profile()
        prof.enable()
        batch(schema, 20)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
