"""Where a batch-1 decode step of the synthetic Qwen2.5-7B Q4_K_M spends GPU time.

Eager steps (CUDA graphs would hide the per-kernel attribution), 512-token context,
torch.profiler over 16 steps. Usage on a GPU box:
    python scripts/profile_decode_step.py QWEN25_TOKENIZER_GGUF
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.synthetic_model import ensure_synthetic_model

path = ensure_synthetic_model("qwen2.5-7b-q4_k_m", tokenizer_source=sys.argv[1], progress=False)
llm = LLM(str(path), device="cuda:0", dtype="f16", progress=False, max_model_len=1024, enforce_eager=True,
          max_active_requests=1)
ids = list(range(1000, 1512))
llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
engine = llm.engine
engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
for _ in range(5):  # the prefill, then a few decode steps
    engine.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(16):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60))
t = time.perf_counter()
for _ in range(16):
    engine.step()
torch.cuda.synchronize()
print("eager step ms", (time.perf_counter() - t) / 16 * 1e3)
