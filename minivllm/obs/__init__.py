"""Observability: traces (Chrome trace JSON for Perfetto, NVTX ranges on CUDA).

`minivllm.obs.trace` holds the trace recorder. It imports nothing from the rest of
minivllm except `errors`, so every other layer may use it.
"""
