#!/usr/bin/env bash
# Runs on the GPU box (no network) for the benchmark-suite issue. Every argument is a stage,
# run in order:
#   stage        install the carried wheels (.whl/g9) and keep the first SmolLM2 chunk
#   peers        batched generation vs transformers' generate (SmolLM2; needs .gpu/smol.part01 carried)
#   dtype        activation dtypes f32/f16/bf16: TTFT, decode tok/s, peak memory
#   offline      offline throughput, 256 requests of 100..1024 + 100..1024 tokens
#   all-quick    `minivllm bench all --quick --device cuda:0`
# Every result file written goes back as one tarball in $OUT. MAX_RUNS caps peers' runs.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
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
for stage in "$@"; do
  case $stage in
  stage)
    cp .gpu/smol.part00 /root/gpu/
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv ;;
  peers)
    assemble
    bench 200 peers --inference-device cuda:0 --batch-sizes 1,8,32,64 --prompt-len 128 --decode-tokens 128 --runs 3 \
          --max-runs ${MAX_RUNS:-5} ;;
  dtype)
    assemble
    bench 120 activation-dtype --model smollm2-135m --inference-device cuda:0 --prompt-tokens 512 --max-tokens 128 \
          --repeats 3 ;;
  offline)
    assemble
    bench 250 offline --model smollm2-135m --inference-device cuda:0 --activation-dtype f16 \
          --option max_active_requests=256 --option max_batched_tokens=8192 --max-seconds 150 ;;
  all-quick)
    assemble
    timeout ${BENCH_TIMEOUT:-360} python3 -m minivllm bench all --quick --device cuda:0 2>&1 | tail -40 ;;
  recheck)  # the default KV pool with the graphs' scratch page: the CUDA test and the two drivers it broke
    assemble
    timeout 200 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tail -5
    timeout 200 python3 -m minivllm bench all --quick --device cuda:0 --only activation-dtype,paged-vs-contiguous \
        2>&1 | tail -8
    bench 150 continuous-batching --parts kv --decode-lengths 512,2048 --inference-device cuda:0 ;;
  *) echo "unknown stage $stage" ;;
  esac
done
find benchmarks/results -newer /tmp/start-marker -type f | tar czf $OUT/results.tgz -T - 2>/dev/null; tar tzf $OUT/results.tgz
