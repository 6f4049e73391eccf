#!/usr/bin/env bash
# Runs on the GPU box (no network) for the benchmark-suite issue. Stages:
#   stage        install the carried wheels (.whl/g9) and keep the first SmolLM2 chunk
#   peers        assemble SmolLM2 (needs .gpu/smol.part01 carried); batched generation vs
#                transformers, activation dtypes with peak memory, offline throughput (256 seqs)
#   all [ARGS]   `minivllm bench all --device cuda:0 ARGS`
# Every result file written goes back as one tarball in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stage=${1:-peers}
shift || true
[ -d /root/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /root/site .whl/g9/*.whl 2>&1 | tail -1
assemble() {
  [ -f $d/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu/smol.part00 .gpu/smol.part01 > $d/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $d/*.gguf
}
bench() {  # bench SECONDS ARGS...: one benchmark, killed after SECONDS
  local limit=$1; shift
  echo "=== minivllm bench $*"; timeout $limit python3 -m minivllm bench "$@" 2>&1 | grep -v '^  ' | tail -30
}
case $stage in
stage)
  cp .gpu/smol.part00 /root/gpu/ ; python3 -c "import transformers, gguf; print(transformers.__version__, gguf.__version__)"
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv ;;
peers)
  assemble
  bench 170 peers --inference-device cuda:0 --batch-sizes 1,8,32,64 --prompt-len 128 --decode-tokens 128 --runs 3
  bench 120 activation-dtype --model smollm2-135m --inference-device cuda:0 --prompt-tokens 512 --max-tokens 128 --repeats 3
  bench 250 offline --model smollm2-135m --inference-device cuda:0 --activation-dtype f16 --option max_active_requests=256 \
        --option max_batched_tokens=8192 --max-seconds 150 ;;
all)
  assemble
  timeout ${BENCH_TIMEOUT:-560} python3 -m minivllm bench all --device cuda:0 "$@" 2>&1 | tail -60 ;;
esac
find benchmarks/results -newer /tmp/start-marker -type f | tar czf $OUT/results.tgz -T - 2>/dev/null; tar tzf $OUT/results.tgz
