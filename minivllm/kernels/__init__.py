"""Numerical building blocks: norms, RoPE, attention, linear layers.

Everything here is the plain-torch reference; later fast paths (Triton on CUDA,
packed-int CPU matmuls) are tested against these functions.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`QuantizedWeight` keeps a projection as its GGUF blocks on the device (memory ≈ file
size). `QuantLinear` picks a path per call from the model's shared `KernelOptions`: rows
≤ `gemv_max_rows` take the fused dequantize-GEMV (Triton on CUDA for
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K/F32/F16/BF16; on CPU the float32 kernel of
`cpu_gemv.cpp` for Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K, the low-precision packs of
`cpu_packed.py` only when asked for (`dtype=bfloat16` or `cpu_gemv="lowp"`); a row-wise
dense GEMV otherwise), more rows dequantize (or use the optional dequant cache) and GEMM
through cuBLAS / MKL; `batch_invariant` sends every row through one per-row
configuration. The path taken is counted per step (snapshot `last_step.kernel_paths`)
and named in the trace (`qmatmul` scope, `path` arg). On CUDA,
Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K projections keep their blocks only in a repacked GPU
layout built at load (`repacked_gemv.py`: int32 quant planes with 4 rows interleaved,
the file's scales in arrays of their own, decoded with magic-number float tricks instead
of int→float conversions; about the file size; `raw` rebuilt on demand for the GEMM
path); the bias is added inside that kernel. One activation row (decode) and
batch-invariant mode take `tiled_gemv.py` (row groups x K slices per program, split-K
summed in slice order, no atomics, by the one rule of `split_sum.py`; the o- and
down-projections' slices are summed inside the next residual add + RMSNorm instead of a
launch of their own, `MINIVLLM_FOLD_SPLIT_SUM=0` keeps that launch), whose launch shape
per (type, N, K) comes from a per-GPU table (`gemv_configs.json`, written by `scripts/gemv_sweep.py` on that GPU);
several rows share one decode of each weight field (up to 8 per program); the kernels decode
the layout through one set of helpers (`repacked_decode.py`). A layer's Q/K/V and gate/up
are one repacked weight per run of one type (`fused_projection.py`: one launch, outputs
as views, the separate linears views of its rows; gate+up with SwiGLU in the tiled
GEMV's epilogue; `MINIVLLM_FUSED_PROJECTIONS=0` keeps them apart); `q8_gemv.py`
(int8 activations per group of 32 and `dp4a`, same tiling, every repacked type) serves
f16/bf16 activations only when asked for by name (`MINIVLLM_Q8_GEMV=1`, on any GPU). Every
capability-based choice (bf16, the int8 path, the table row) reads `gpu_profile.py`, and
`MINIVLLM_GPU_PROFILE=sm75` makes them a T4's on any GPU. A type whose kernel fails to
compile falls back to dequantize + cuBLAS with a warning naming it. With
the dequant cache on, CUDA GEMV serves 1 row and cuBLAS 2 or more. `paged_attention` is
flash-decoding (splits of a fixed 64 tokens, then an in-order merge kernel) for any mix
of rows (decode rows, prefill chunks after cached pages): one program per (row, KV head,
split) reads that split's keys in place with an online softmax, GQA heads grouped so K/V
are never repeated. `rms_norm_rows` reduces each row the same way whatever the batch. On
CUDA the decoder runs each layer with three fused kernels (`fused.py`: residual add +
RMSNorm, RoPE on q and k, SwiGLU). Every Triton kernel avoids `tl.dot` and bf16
arithmetic so sm_75 (T4) can run it, and runs under `TRITON_INTERPRET=1` on CPU tensors
for the tests. The plain-torch references stay: f32 RMSNorm, RoPE in both GGUF layouts,
SDPA attention (with a two-bmm fast path for one query)
"""
