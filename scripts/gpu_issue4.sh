#!/usr/bin/env bash
# Runs on the GPU box (no network) for the kernels issue. Stage 1 ("stage"): keep the
# first model chunk and install the carried wheels. Stage 2 ("tests"): assemble
# SmolLM2, run every CUDA test and the small-model benchmarks. Stage 3 ("7b"): the
# synthetic Qwen2.5-7B Q4_K_M decode benchmark. Results go to $OUT.
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
  timeout ${PYTEST_TIMEOUT:-330} python3 -m pytest -q -m cuda -p no:cacheprovider -x tests/ "$@" 2>&1 | tee $OUT/pytest-cuda.log | tail -30
  timeout 120 python3 -m minivllm bench decode --inference-device cuda:0 --activation-dtype f16 --max-tokens 128 --repeats 3 2>&1 | tail -6
  timeout 150 python3 -m minivllm bench gemv-threshold --inference-device cuda:0 --activation-dtype f16 --max-tokens 32 --repeats 2 --batch-invariant 2>&1 | tail -12
  find benchmarks/results -newer /tmp/start-marker -type f -exec cp {} $OUT/ \; ; ls $OUT ;;
7b)
  shift
  timeout 560 python3 -m minivllm bench decode --synthetic qwen2.5-7b-q4_k_m --synthetic-tokenizer /root/gpu/qwen-tokenizer.gguf \
    --inference-device cuda:0 --activation-dtype f16 --max-tokens 128 --repeats 3 "$@" 2>&1 | tail -8
  find benchmarks/results -newer /tmp/start-marker -type f -exec cp {} $OUT/ \; ; ls $OUT ;;
esac
