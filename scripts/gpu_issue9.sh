#!/usr/bin/env bash
# Runs on the GPU box (no network) for the reliability issue. Stages:
#   stage            install the carried wheels (.whl/g9) and keep the first SmolLM2 chunk
#   tests [PATHS]    assemble SmolLM2 (needs .gpu/smol.part01 carried) and run the CUDA tests given
#   soak [ARGS]      `minivllm bench soak` on SmolLM2 with a GPU worker and a CPU worker
# Results go to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stage=${1:-tests}
shift || true
[ -d /root/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /root/site .whl/g9/*.whl 2>&1 | tail -1
assemble() {
  [ -f $d/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu/smol.part00 .gpu/smol.part01 > $d/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $d/*.gguf
}
case $stage in
stage)
  cp .gpu/smol.part00 /root/gpu/ ; ls -la /root/gpu /root/site | head -20 ;;
tests)
  assemble
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
  timeout ${PYTEST_TIMEOUT:-400} python3 -m pytest -q -m cuda -p no:cacheprovider "$@" 2>&1 | tee $OUT/pytest-cuda.log | tail -25 ;;
soak)
  assemble
  timeout ${BENCH_TIMEOUT:-560} python3 -m minivllm bench soak --model $d/SmolLM2-135M-Instruct.Q4_1.gguf "$@" 2>&1 | tail -40
  find benchmarks/results -newer /tmp/start-marker -type f -exec cp {} $OUT/ \; ; ls $OUT ;;
esac
