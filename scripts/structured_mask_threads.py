"""Mask threads x torch CPU threads vs constrained batch-16 decode, on a GPU (issue 24 follow-up).

    python scripts/structured_mask_threads.py QWEN_TOKENIZER(.gguf or tokenizer-fields .json.xz)
"""
import statistics
import sys
import time

import torch
from minivllm.engine.llm import LLM
from minivllm.bench.structured_cost import _params
from minivllm.bench.synthetic_model import ensure_synthetic_model
path = ensure_synthetic_model("qwen2.5-0.5b-q4_k_m", tokenizer_source=sys.argv[1])
llm = LLM(str(path), device="cuda", dtype="float16", progress=False, max_model_len=256, prefix_cache=False, max_active_requests=16)
def go(mode):
    prompts = [f"Request {i}: list products as JSON." for i in range(16)]
    t = time.perf_counter(); llm.generate(prompts, _params(mode, 16, 64)); return time.perf_counter() - t
go("unconstrained"); go("json_schema, every row")
for torch_threads in (16, 1):
    torch.set_num_threads(torch_threads)
    for workers in (1, 4, 8, 15):
        c = llm.engine._constraints
        c._workers = workers; c._pool = None
        rows = {m: statistics.median(go(m) for _ in range(3)) for m in ("unconstrained", "json_schema, every row", "json_schema (free-length strings), every row")}
        base = rows["unconstrained"]
        print(f"torch threads {torch_threads:2d} mask threads {workers:2d}: " + ", ".join(f"{k} {base / v:.3f}x" for k, v in rows.items()), flush=True)
