#!/usr/bin/env bash
# Runs on the GPU box (no network) for issue 19 (GPU decode vs llama.cpp). Needs carried:
# .whl (gguf, platformdirs wheels) and .gpu19 (llama.cpp.tar.xz, build_on_gpu.sh and
# qwen2.5-tokenizer-fields.json.xz from ../shared/peers). Every argument is a stage:
#   bg          start, in their own sessions: the llama.cpp build (sm_90) and the writing of
#               the two synthetic Q4_K_M files (0.5B exact layout, 7B) into the model cache
#   tests       the CUDA tests of the Triton kernels (repacked GEMV, old GEMV, paged attention)
#   kernels     `minivllm bench kernels` on the 7B shapes (old and repacked GEMV)
#   mv05 / mv7  `minivllm bench decode` on the synthetic 0.5B / 7B file (f16, graphs and eager)
#   mvctx       7B decode after a 4096-token prompt (minivllm)
#   q8          the opt-in int8-activation GEMV (MINIVLLM_Q8_GEMV=1): kernels, then 7B and 0.5B decode
#   llama       llama-bench on both files (pp512 + tg128, and tg128 after 0/512/4096 tokens on the 7B)
# Result files and logs go to $OUT.
set -uo pipefail
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 MINIVLLM_CACHE=/root/mcache MINIVLLM_OFFLINE=1 \
       MINIVLLM_TEST_SKIP_MISSING_MODELS=1 HF_HUB_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
touch /tmp/start-marker
START=$(date +%s); BUDGET=${BUDGET:-570}  # seconds this call may run (the tool's limit is 600)
left() { echo $((START + BUDGET - $(date +%s))); }
tmo() { local l=$(( $(left) - 25 )); [ $l -lt 1 ] && l=1; echo $(( $1 < l ? $1 : l )); }  # a stage's limit
O=/root/out19; rm -rf $O; mkdir -p $O  # logs, tarred into $OUT at the end (8 files at most come back)
[ -d /root/site/gguf ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /root/site .whl/*.whl 2>&1 | tail -1
TOK=$PWD/.gpu19/qwen2.5-tokenizer-fields.json.xz
LLAMA=/root/llama/llama.cpp/build/bin
model_path() { python3 -c "from minivllm.bench.synthetic_model import synthetic_model_path as p; print(p('$1'))"; }
wait_for() {  # wait_for FILE SECONDS
  local i=0; while [ ! -e "$1" ] && [ $i -lt $2 ]; do sleep 2; i=$((i + 2)); done; [ -e "$1" ]
}
for stage in "$@"; do
  echo "=== stage $stage at $(date +%T), $(left) s left"
  [ $(left) -lt 40 ] && { echo "skipped: no time left"; continue; }
  case $stage in
  bg)
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.sm --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    [ -e /root/llama.done ] || setsid nohup bash -c "bash .gpu19/build_on_gpu.sh .gpu19/llama.cpp.tar.xz /root/llama 90 \
        > /root/llama-build.log 2>&1 && touch /root/llama.done" > /dev/null 2>&1 < /dev/null &
    for m in qwen2.5-0.5b-q4_k_m qwen2.5-7b-q4_k_m; do
      [ -e /root/$m.done ] || setsid nohup bash -c "python3 -c \"from minivllm.bench.synthetic_model import \
ensure_synthetic_model as e; print(e('$m', tokenizer_source='$TOK'))\" > /root/$m.log 2>&1 && touch /root/$m.done" \
          > /dev/null 2>&1 < /dev/null &
    done ;;
  tests)
    timeout $(tmo ${PYTEST_TIMEOUT:-300}) python3 -m pytest -q -x -m cuda -p no:cacheprovider tests/test_triton_repacked_gemv.py \
        tests/test_triton_paged_attention.py tests/test_triton_fused.py tests/test_triton_q8_gemv.py 2>&1 | tee $O/pytest-cuda-repacked.log | tail -8
    timeout $(tmo 200) python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_triton_gemv.py 2>&1 \
        | tee $O/pytest-cuda-gemv.log | tail -3 ;;
  kernels)
    # (python -c, not the CLI: the CLI imports the server's packages, absent on this image)
    timeout $(tmo ${KERNELS_TIMEOUT:-240}) python3 -c "from minivllm.bench.kernels import run; \
run(types='${KTYPES:-Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q6_K}'.split(','), device='cuda:0')" 2>&1 | grep "REPACKED\|CUBLAS\|copy band\|Error" ;;
  mv05 | mv7)
    m=$([ $stage = mv05 ] && echo qwen2.5-0.5b-q4_k_m || echo qwen2.5-7b-q4_k_m)
    wait_for /root/$m.done 300 || { echo "model $m not written"; tail -5 /root/$m.log; continue; }
    timeout $(tmo ${DECODE_TIMEOUT:-240}) python3 -c "from minivllm.bench.decode import run; run(devices=['cuda:0'], \
dtypes=['f16'], synthetic='$m', synthetic_tokenizer='$TOK', prompt_tokens=512, max_tokens=128, repeats=3, max_repeats=4)" \
        2>&1 | grep "^ *minivllm\|Error" ;;
  mvctx)
    m=qwen2.5-7b-q4_k_m
    wait_for /root/$m.done 300 || continue
    timeout $(tmo ${DECODE_TIMEOUT:-240}) python3 -c "from minivllm.bench.decode import run; run(devices=['cuda:0'], \
dtypes=['f16'], synthetic='$m', synthetic_tokenizer='$TOK', prompt_tokens=4096, max_tokens=128, repeats=3, max_repeats=3)" \
        2>&1 | grep "^ *minivllm\|Error" ;;
  q8)
    MINIVLLM_Q8_GEMV=1 timeout $(tmo 150) python3 -c "from minivllm.bench.kernels import run; \
run(types=['Q4_K', 'Q8_0'], device='cuda:0')" 2>&1 | grep "REPACKED\|Error"
    for m in qwen2.5-7b-q4_k_m qwen2.5-0.5b-q4_k_m; do
      wait_for /root/$m.done 300 || continue
      MINIVLLM_Q8_GEMV=1 timeout $(tmo 130) python3 -c "from minivllm.bench.decode import run; run(devices=['cuda:0'], \
dtypes=['f16'], synthetic='$m', synthetic_tokenizer='$TOK', prompt_tokens=512, max_tokens=128, repeats=3, max_repeats=3)" \
          2>&1 | grep "^ *minivllm\|Error"
    done ;;
  llama)
    wait_for /root/llama.done $(( $(left) - 100 )) || { echo "llama.cpp not built"; tail -5 /root/llama-build.log; continue; }
    (cd /root/llama/llama.cpp && echo "llama.cpp commit: $(cat .commit 2>/dev/null || echo 0c1e57098bba43ac29e6e3b677cdceebdd22334f)")
    for m in qwen2.5-0.5b-q4_k_m qwen2.5-7b-q4_k_m; do
      f=$(model_path $m); [ -e "$f" ] || continue
      cmd="$LLAMA/llama-bench -m $f -ngl 99 -p 512 -n 128 -r 5 -o json"
      echo "$cmd" > $O/llama-bench-$m.cmd
      timeout $(tmo 120) $cmd > $O/llama-bench-$m.json 2> $O/llama-bench-$m.err
      python3 -c "import json; [print('$m', r['n_prompt'], r['n_gen'], r['n_depth'] if 'n_depth' in r else '', round(r['avg_ts'], 1), '+-', round(r['stddev_ts'], 1)) for r in json.load(open('$O/llama-bench-$m.json'))]" \
        || tail -3 $O/llama-bench-$m.err
    done
    f=$(model_path qwen2.5-7b-q4_k_m)
    cmd="$LLAMA/llama-bench -m $f -ngl 99 -p 0 -n 128 -d 0,512,4096 -r 3 -o json"
    echo "$cmd" > $O/llama-bench-ctx.cmd
    timeout $(tmo 120) $cmd > $O/llama-bench-ctx.json 2> $O/llama-bench-ctx.err
    python3 -c "import json; [print('7b ctx', r.get('n_depth'), r['n_gen'], round(r['avg_ts'], 1)) for r in json.load(open('$O/llama-bench-ctx.json'))]" \
      || tail -3 $O/llama-bench-ctx.err ;;
  *) echo "unknown stage $stage" ;;
  esac
done
find benchmarks/results -newer /tmp/start-marker -type f | tar czf $OUT/results.tgz -T - 2>/dev/null; tar tzf $OUT/results.tgz
tar czf $OUT/logs.tgz -C $O . ; tar tzf $OUT/logs.tgz | tr '\n' ' '; echo; echo "left: $(left) s"
