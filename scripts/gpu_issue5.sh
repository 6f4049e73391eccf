#!/usr/bin/env bash
# Runs on the GPU box (no network) for the prefix-cache issue. Stage "stage": install the
# carried wheels and keep the first SmolLM2 chunk. Stage "tests": assemble SmolLM2, run the
# CUDA tests and `bench prefix-cache` on it. Stage "7b PARTS": the same benchmark on the
# synthetic Qwen2.5-7B Q4_K_M (written on first use). Results go to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stage=${1:-tests}
case $stage in
stage)
  python3 -m pip install -q --no-deps --no-index --target /root/site .whl/synth/*.whl 2>&1 | tail -1
  cp .gpu/smol.part00 /root/gpu/ ; ls -la /root/gpu ;;
tests)
  [ -d /root/site/gguf ] || python3 -m pip install -q --no-deps --no-index --target /root/site .whl/synth/*.whl 2>&1 | tail -1
  [ -f $d/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu/smol.part00 .gpu/smol.part01 > $d/SmolLM2-135M-Instruct.Q4_1.gguf
  cp .gpu/qwen-tokenizer.gguf /root/gpu/ 2>/dev/null
  sha256sum $d/*.gguf
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
  shift
  timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -q -m cuda -p no:cacheprovider tests/ "$@" 2>&1 | tee $OUT/pytest-cuda.log | tail -15
  timeout ${BENCH_TIMEOUT:-330} python3 -m minivllm bench prefix-cache --inference-device cuda:0 --activation-dtype f16 2>&1 | tail -70
  find benchmarks/results -newer /tmp/start-marker -type f -exec cp {} $OUT/ \; ; ls $OUT ;;
7b)
  parts=${2:-single-flight,distinct}; shift; shift
  [ -d /root/site/gguf ] || python3 -m pip install -q --no-deps --no-index --target /root/site .whl/synth/*.whl 2>&1 | tail -1
  [ -f /root/gpu/qwen-tokenizer.gguf ] || cp .gpu/qwen-tokenizer.gguf /root/gpu/
  timeout ${BENCH_TIMEOUT:-560} python3 -m minivllm bench prefix-cache --synthetic qwen2.5-7b-q4_k_m \
    --synthetic-tokenizer /root/gpu/qwen-tokenizer.gguf --inference-device cuda:0 --activation-dtype f16 \
    --parts $parts "$@" 2>&1 | tail -60
  find benchmarks/results -newer /tmp/start-marker -type f -exec cp {} $OUT/ \; ; ls $OUT ;;
esac
