"""A fixed decode workload on the CPU, timed in process CPU seconds and wall seconds per
step: batch 1 (200 steps) and batch 4 (100 steps), or batch 4 alone (300 steps) with a
second argument; greedy, float32, one thread, the default model. Prints one JSON line.

    PYTHONPATH=<checkout> python scripts/decode_cpu_per_step.py LABEL [b4]

On a shared machine the CPU time a process spends per step moves much less with its
neighbours' load than wall time does: run two checkouts in turn (A B A B ...) and compare
the paired ratios (issue 40's before/after check). `minivllm bench decode` remains the
speed benchmark; this only isolates the per-step cost.
"""
import json
import sys
import time

import torch

from minivllm import LLM, SamplingParams

torch.set_num_threads(1)
llm = LLM("smollm2-135m", device="cpu", dtype="float32", progress=False, max_model_len=512)
engine = llm.engine
prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "In a distant galaxy"]
out = {}
BATCHES = ((4, 300),) if len(sys.argv) > 2 else ((1, 200), (4, 100))
for batch, steps in BATCHES:
    for warm in (True, False):
        n = 8 if warm else steps
        rids = [engine.add_request(llm.tokenizer.encode(p), SamplingParams(temperature=0.0, max_tokens=n + 2,
                                                                          ignore_eos=True))
                for p in prompts[:batch]]
        while any(engine.request_state(r).phase != "decode" for r in rids):
            engine.step()
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            engine.step()
        c1, w1 = time.process_time(), time.perf_counter()
        for r in rids:
            engine.release(r)
        if not warm:
            out[f"batch{batch}"] = {"steps": n, "cpu_ms_per_step": 1000 * (c1 - c0) / n,
                                    "wall_ms_per_step": 1000 * (w1 - w0) / n}
print(json.dumps({"src": sys.argv[1], **out}), flush=True)
