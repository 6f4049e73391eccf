"""Observability: traces (Chrome trace JSON for Perfetto, NVTX ranges on CUDA).

`minivllm.obs.trace` holds the trace recorder. It imports nothing from the rest of
minivllm except `errors`, so every other layer may use it.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`machine.cpu_fingerprint()`: the CPU model, ISA flags, torch's CPU capability, BLAS and
thread count that decide CPU float rounding (a divergence report and its committed case
carry it, so a split position is read as a fact about one machine). The trace recorder:
scopes (`step`, `model`, `layer`, `attn`, `mlp`, `qmatmul`, `sample`) written as Chrome
trace JSON, and NVTX ranges on CUDA. It is a leaf module, imported nothing from minivllm
but `errors`, so every layer may call it. When tracing is off, a scope is one boolean
check and a shared no-op object
"""
