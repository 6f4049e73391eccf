#!/usr/bin/env bash
# Runs on the GPU box (no network) for the speculative-decoding issue. Stage "stage":
# install the carried wheels and keep the first SmolLM2 chunk. Stage "tests": assemble
# SmolLM2 and run the CUDA tests. Stage "bench [ARGS]": `bench speculative` on the
# synthetic Qwen2.5-7B Q4_K_M target + 0.5B-class draft (written on first use). Results
# go to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stage=${1:-tests}
[ -d /root/site/gguf ] || python3 -m pip install -q --no-deps --no-index --target /root/site .whl/synth/*.whl 2>&1 | tail -1
case $stage in
stage)
  cp .gpu/smol.part00 /root/gpu/ ; ls -la /root/gpu ;;
tests)
  [ -f $d/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu/smol.part00 .gpu/smol.part01 > $d/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f .gpu/qwen-tokenizer.gguf ] && cp .gpu/qwen-tokenizer.gguf /root/gpu/
  sha256sum $d/*.gguf
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
  shift
  timeout ${PYTEST_TIMEOUT:-400} python3 -m pytest -q -m cuda -p no:cacheprovider "$@" 2>&1 | tee $OUT/pytest-cuda.log | tail -25 ;;
bench)
  shift
  [ -f /root/gpu/qwen-tokenizer.gguf ] || cp .gpu/qwen-tokenizer.gguf /root/gpu/
  timeout ${BENCH_TIMEOUT:-560} python3 -m minivllm bench speculative --synthetic-pair \
    --synthetic-tokenizer /root/gpu/qwen-tokenizer.gguf --inference-device cuda:0 --activation-dtype f16 "$@" 2>&1 \
    | grep -v '^$' | head -60
  find benchmarks/results -newer /tmp/start-marker -type f -exec cp {} $OUT/ \; ; ls $OUT ;;
esac
