#!/usr/bin/env bash
# Runs on the GPU box (no network): assemble the carried model chunks, then the CUDA
# tests, a CLI generation on the GPU, and the decode benchmark. Output goes to $OUT.
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 MINIVLLM_CACHE=/root/mcache MINIVLLM_OFFLINE=1 MINIVLLM_TEST_SKIP_MISSING_MODELS=1
d=$MINIVLLM_CACHE/models/smollm2-135m; mkdir -p $d
[ -f $d/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu/smol.part00 .gpu/smol.part01 > $d/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum $d/*.gguf
python3 -m minivllm models list | head -4
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
python3 -m pytest -q -m cuda -p no:cacheprovider tests/ "$@" 2>&1 | tee $OUT/pytest-cuda.log | tail -25
python3 -m minivllm generate --inference-device gpu --activation-dtype f16 --max-tokens 48 "The three most useful things to know about GPUs are" 2>&1 | tail -3
python3 -m minivllm generate --inference-device cuda:0 --activation-dtype bf16 --chat --max-tokens 48 "Explain what a KV cache is in two sentences." 2>&1 | tail -3
python3 -m minivllm bench decode --inference-device cpu --inference-device cuda:0 --activation-dtype f32 --activation-dtype f16 --activation-dtype bf16 --max-tokens 64 --repeats 3 2>&1 | tail -20
cp benchmarks/results/* $OUT/ 2>/dev/null
