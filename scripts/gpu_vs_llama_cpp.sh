#!/usr/bin/env bash
# minivllm against llama.cpp on one lent GPU, in two device runs (issue 41).
#
#   here:     scripts/gpu_vs_llama_cpp.sh stage DEST     # stage tree, wheels, llama.cpp sources, tokenizer fields
#   run 1:    cd DEST && source env.sh && cd tree && bash scripts/gpu_vs_llama_cpp.sh 1
#   run 2:    (the same, with 2) right after run 1, on the same warm machine
#   here:     python3 scripts/gpu_vs_llama_cpp_table.py run1.tgz run2.tgz   # the one JSON + Markdown table
#   any time: ... profile   # pytest -m cuda in both profiles, then a profile of decode steps (no peer)
#   short of device time: ... once   # the most important rows of runs 1 and 2 in one call
#   minivllm alone: ... lean (the rows still unmeasured: GEMV sweep with the read ceiling and
#                   the in-launch split sum on the 7B shapes, the newest CUDA tests, 7B decode
#                   at 512 and 4096 tokens, PDL on (the default) and off) | quick (GEMV tests, decode rows) | attention (T4-profile tests, attention, 4096 profile)
#                   | verify (native CUDA tests; SM75_PYTEST=1 the T4-profile ones too; GPU -> CPU bench)
#                   | early-ab (scripts/gpu_early_ab.sh: the latest A/Bs, the export bench, GEMV sweeps per EARLY value)
#
# Run 1 starts the llama.cpp build (build_on_gpu.sh, about 5 minutes on 16 cores) and the
# synthetic Qwen2.5 0.5B / 7B Q4_K_M files in the background (both on the CPU), sweeps the
# GEMV launch shapes (scripts/gemv_sweep.py: the GPU alone), then runs `pytest -m cuda`
# under the T4 profile (MINIVLLM_GPU_PROFILE=sm75; natively: the `verify` mode). Run 2 waits
# for the build, then times both engines on the same files: llama-bench (pp512, tg128,
# tg128 after 512 and 4096 tokens), llama-batched-bench (1/8/32 sequences, 128 + 128) and
# minivllm's bench decode / batched decode, natively (with run 1's GEMV table), with the
# int8 GEMV, under the T4 profile and in batch-invariant mode. Run 1 ends with issue 43's
# `bench disaggregation` (GPU prefill, CPU decode; DISAGG=0 skips it).
#
# Everything persistent lives in W (default /root/i41), outside the carried tree, so run 2
# finds run 1's build, files and table when the machine is still warm (a cold machine
# rebuilds in run 2: slower, same result). Each run leaves OUT/runN.tgz (logs and result
# files) and OUT/runN-summary.txt; the device tool brings back at most 8 files.
set -uo pipefail

MODE=${1:?usage: gpu_vs_llama_cpp.sh stage DEST | 1 | 2 | 3 | once | lean | early-ab | quick | attention | verify | profile}
HERE=$(cd "$(dirname "$0")/.." && pwd)

if [ "$MODE" = stage ]; then
  DEST=${2:?usage: gpu_vs_llama_cpp.sh stage DEST}
  PYTHON=${PYTHON:-$HERE/.venv/bin/python}
  MODELS="" WHEELS=${WHEELS:-gguf platformdirs llguidance} PYTHON=$PYTHON \
    bash "$HERE/scripts/stage_offline_gpu.sh" "$DEST" || exit $?
  # What the CUDA test modules import beyond the GPU image (the serving stack, the test
  # plugins), with their dependencies, for the image's Python 3.12: without them `pytest -m
  # cuda` cannot collect those modules. Packages the image has (numpy, pytest, requests, ...)
  # are dropped so they are not shadowed. The notebook extra stays out (plotly alone is ~15 MB
  # of the 64 MiB a device call carries); tests/conftest.py leaves its tests uncollected there.
  "$PYTHON" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 -d "$DEST/wheels" \
    ${SERVING_WHEELS:-jsonschema uvicorn openai fastapi prometheus-client httpx psutil lark pytest-xdist \
      pytest-timeout} || exit $?
  (cd "$DEST/wheels" && rm -f numpy-* pyyaml-* PyYAML-* requests-* urllib3-* certifi-* charset_normalizer-* \
    idna-* pytest-[0-9]* pluggy-* iniconfig-* pygments-* packaging-* truststore-*)
  echo "stage: $(ls "$DEST/wheels" | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in all"
  exit 0
fi

W=${W:-/root/i41}
OUT=${OUT:-$W/out}
FIELDS=../peers/qwen2.5-tokenizer-fields.json.xz
LLAMA_BIN=$W/llama/llama.cpp/build/bin
export MINIVLLM_CACHE=$W/cache LLAMA_CPP_COMMIT=0c1e57098bba43ac29e6e3b677cdceebdd22334f
# CUDA tests that need a model fall back to the synthetic Qwen2.5-0.5B written from these fields.
MINIVLLM_TEST_SYNTHETIC_FIELDS=$(cd "$(dirname "$FIELDS")" 2>/dev/null && pwd)/$(basename "$FIELDS")
export MINIVLLM_TEST_SYNTHETIC_FIELDS
mkdir -p "$W/res$MODE" "$OUT" "$MINIVLLM_CACHE"
R=$W/res$MODE
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/timeline.txt"; }
BUDGET=${BUDGET:-560}  # seconds this run may take (a device call stops at 600)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
step() {  # step NAME LOG CMD...: run CMD under the time left (skipped when under 30 s); the
  # benchmarks/results files it writes are copied to R, prefixed with LOG's name
  local name=$1 log=$2 rc f; shift 2
  if [ "$(left)" -lt 30 ]; then stamp "SKIPPED $name (out of time)"; return 0; fi
  touch "$R/.marker"
  timeout "$(left)" "$@" > "$log" 2>&1
  rc=$?
  for f in $(find benchmarks/results -newer "$R/.marker" -type f 2>/dev/null); do
    cp "$f" "${log%.*}--$(basename "$f")"
  done
  stamp "$name exit $rc"
}

synthetic() {  # path of a synthetic file (written if missing)
  python3 - "$1" "$FIELDS" <<'PY'
import sys
from minivllm.bench.synthetic_model import ensure_synthetic_model
print(ensure_synthetic_model(sys.argv[1], tokenizer_source=sys.argv[2], progress=False))
PY
}

run_pytest() {  # both profiles side by side, each under the time left minus RESERVE seconds
  local PYTEST="python3 -m pytest -q -m cuda -p no:cacheprovider -rfE -n 4 --dist loadfile --timeout 120" t p1 p2 e1 e2
  python3 -c "import xdist, pytest_timeout" 2>/dev/null || PYTEST="python3 -m pytest -q -m cuda -p no:cacheprovider -rfE"
  t=$(( $(left) - ${RESERVE:-0} )); [ $t -lt 60 ] && t=60
  timeout $t $PYTEST > "$R/pytest-cuda-native.log" 2>&1 &
  p1=$!
  MINIVLLM_GPU_PROFILE=sm75 timeout $t $PYTEST > "$R/pytest-cuda-sm75.log" 2>&1 &
  p2=$!
  wait $p1; e1=$?; wait $p2; e2=$?
  stamp "pytest native exit $e1: $(tail -n 1 "$R/pytest-cuda-native.log")"
  stamp "pytest sm75 exit $e2: $(tail -n 1 "$R/pytest-cuda-sm75.log")"
}

start_7b_file() {  # the synthetic 7B file, written in the background (its path: line 2 of synthetic.log)
  setsid nohup bash -c "python3 -c \"
from minivllm.bench.synthetic_model import ensure_synthetic_model as e
print(e('qwen2.5-7b-q4_k_m', tokenizer_source='$FIELDS', progress=False), flush=True)
\"" >> "$W/synthetic.log" 2>&1 < /dev/null &
}

decode_rows() {  # minivllm's batch-1 decode (defaults; then the GEMV's first trip loaded early) at 512 tokens (both files) and 4096 (7B)
  while pgrep -f ensure_synthetic_model > /dev/null; do sleep 2; done
  S05=$(sed -n 1p "$W/synthetic.log"); S7=$(sed -n 2p "$W/synthetic.log")
  local DEC="python3 -m minivllm bench decode --activation-dtype f16 --inference-device cuda:0 --runs 3 --max-runs 3 --max-tokens 128 --no-eager-row"
  local SYN="--synthetic-tokenizer $FIELDS --synthetic" s
  for s in qwen2.5-7b-q4_k_m qwen2.5-0.5b-q4_k_m; do
    step "decode $s" "$R/decode-$s.log" $DEC $SYN $s --prompt-tokens 512
    step "decode early $s" "$R/decode-early-$s.log" env MINIVLLM_GEMV_EARLY_LOAD=1 $DEC $SYN $s --prompt-tokens 512
  done
  step "decode 7b after 4096" "$R/decode-7b-4096.log" $DEC $SYN qwen2.5-7b-q4_k_m --prompt-tokens 4096
  step "decode plain attention 7b after 4096" "$R/decode-plainattn-7b-4096.log" env MINIVLLM_ATTENTION_MMA=0 $DEC \
    $SYN qwen2.5-7b-q4_k_m --prompt-tokens 4096
}

decode_rows_pdl() {  # batch-1 decode, 7B at 512 and 4096 tokens with PDL on (the default) and off, then the 0.5B
  # The 4096 / 512 ratio was 0.962 in h100-s49 (PDL off) and 0.945-0.947 since PDL went on.
  while pgrep -f ensure_synthetic_model > /dev/null; do sleep 2; done
  S05=$(sed -n 1p "$W/synthetic.log"); S7=$(sed -n 2p "$W/synthetic.log")
  local DEC="python3 -m minivllm bench decode --activation-dtype f16 --inference-device cuda:0 --runs 3 --max-runs 3 --max-tokens 128 --no-eager-row"
  local SYN="--synthetic-tokenizer $FIELDS --synthetic"
  step "decode 7b" "$R/decode-qwen2.5-7b-q4_k_m.log" $DEC $SYN qwen2.5-7b-q4_k_m --prompt-tokens 512
  step "decode 7b after 4096" "$R/decode-7b-4096.log" $DEC $SYN qwen2.5-7b-q4_k_m --prompt-tokens 4096
  step "decode 7b pdl off" "$R/decode-nopdl-qwen2.5-7b-q4_k_m.log" env MINIVLLM_PDL=0 \
    $DEC $SYN qwen2.5-7b-q4_k_m --prompt-tokens 512
  step "decode 7b after 4096 pdl off" "$R/decode-nopdl-7b-4096.log" env MINIVLLM_PDL=0 \
    $DEC $SYN qwen2.5-7b-q4_k_m --prompt-tokens 4096
  step "decode 0.5b" "$R/decode-qwen2.5-0.5b-q4_k_m.log" $DEC $SYN qwen2.5-0.5b-q4_k_m --prompt-tokens 512
  step "decode 7b early off" "$R/decode-noearly-qwen2.5-7b-q4_k_m.log" env MINIVLLM_GEMV_EARLY_LOAD=0 \
    $DEC $SYN qwen2.5-7b-q4_k_m --prompt-tokens 512
}

if [ "$MODE" = profile ]; then
  # Where a decode step's time goes (scripts/profile_decode_step.py), with both pytest
  # profiles first (they share the GPU with the synthetic-file writer, not with the profile).
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; } > "$R/device.txt" 2>&1
  ( synthetic qwen2.5-0.5b-q4_k_m; synthetic qwen2.5-7b-q4_k_m ) > "$W/synthetic.log" 2>&1 &
  sp=$!
  RESERVE=${RESERVE:-300} run_pytest
  wait $sp
  P="python3 scripts/profile_decode_step.py $R/profile $FIELDS"
  step "profile graphs 512" "$R/profile-graphs.log" $P --prompt-tokens 512
  step "profile eager 7b 512" "$R/profile-eager.log" $P --synthetic qwen2.5-7b-q4_k_m --prompt-tokens 512 --eager
  cat "$R"/profile/*.md > "$OUT/profile.md" 2>/dev/null
elif [ "$MODE" = 3 ]; then
  # A third run (a fresh machine is fine): both pytest profiles again, then the int8 GEMV and
  # the T4 profile beside the native path and llama.cpp (rebuilt here in the background).
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; } > "$R/device.txt" 2>&1
  [ -x "$LLAMA_BIN/llama-batched-bench" ] || setsid nohup nice -n 15 bash ../peers/build_on_gpu.sh \
    ../peers/llama.cpp.tar.xz "$W/llama" 90 > "$W/llama-build.log" 2>&1 < /dev/null &
  ( synthetic qwen2.5-0.5b-q4_k_m; synthetic qwen2.5-7b-q4_k_m ) > "$W/synthetic.log" 2>&1 &
  sp=$!
  RESERVE=330 run_pytest
  wait $sp
  S05=$(sed -n 1p "$W/synthetic.log"); S7=$(sed -n 2p "$W/synthetic.log")
  stamp "files: $S05 $S7"
  DEC="python3 -m minivllm bench decode --activation-dtype f16 --inference-device cuda:0 --runs 3 --max-runs 3 --max-tokens 128 --no-eager-row"
  SYN="--synthetic-tokenizer $FIELDS --synthetic"
  for s in qwen2.5-7b-q4_k_m qwen2.5-0.5b-q4_k_m; do
    step "decode int8 $s" "$R/decode-int8-$s.log" env MINIVLLM_Q8_GEMV=1 $DEC $SYN $s --prompt-tokens 512
    step "decode native $s" "$R/decode-native-$s.log" $DEC $SYN $s --prompt-tokens 512
    step "decode T4 profile $s" "$R/decode-sm75-$s.log" env MINIVLLM_GPU_PROFILE=sm75 $DEC $SYN $s --prompt-tokens 512
  done
  stamp "llama build: $(tail -n 1 "$W/llama-build.log")"
  if [ -x "$LLAMA_BIN/llama-bench" ]; then
    step "llama-bench 7b" "$R/llama-bench-7b.log" bash -c "'$LLAMA_BIN/llama-bench' -m '$S7' -ngl 99 -p 512 -n 128 \
      -d 0,512 -r 5 -o json > '$R/llama-bench-7b.json'"
    step "batched int8 7b" "$R/batched-int8-7b.log" env MINIVLLM_Q8_GEMV=1 python3 -m minivllm bench offline \
      --model "$S7" --llama-batched-bench "$LLAMA_BIN/llama-batched-bench"
  else
    step "batched int8 7b (no peer: build unfinished)" "$R/batched-int8-7b.log" env MINIVLLM_Q8_GEMV=1 \
      python3 scripts/gpu_batched_decode.py "$S7" "$R/batched-int8-7b.json"
  fi
elif [ "$MODE" = attention ]; then
  # minivllm alone, one call: pytest -m cuda in the T4 profile (each test named in the log),
  # the attention sweep (with the tensor-core body's rows), 7B decode at 512 and 4096 by
  # default and with the plain attention body (MINIVLLM_ATTENTION_MMA=0), a step profile at
  # 4096, and one GPU -> CPU split.
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nproc; } > "$R/device.txt" 2>&1
  synthetic qwen2.5-0.5b-q4_k_m > "$W/synthetic.log" 2>&1
  start_7b_file
  BUDGET=$(( $(date +%s) - T0 + ${PYTEST_BUDGET:-190} )) step "pytest sm75" "$R/pytest-cuda-sm75.log" \
    env MINIVLLM_GPU_PROFILE=sm75 python3 -m pytest -m cuda -v -n 8 --timeout 90 -p no:cacheprovider -rfE
  stamp "pytest sm75: $(tail -n 1 "$R/pytest-cuda-sm75.log")"
  BUDGET=$(( $(date +%s) - T0 + ${ATTN_SWEEP_BUDGET:-100} )) step "attention sweep" "$R/attention-sweep.log" \
    python3 scripts/attention_bench.py "$R/attention-sweep.json" --sweep --sweep-only --batches 1,8 --contexts 512,4096
  while pgrep -f ensure_synthetic_model > /dev/null; do sleep 2; done
  S05=$(sed -n 1p "$W/synthetic.log")
  DEC="python3 -m minivllm bench decode --activation-dtype f16 --inference-device cuda:0 --runs 3 --max-runs 3 --max-tokens 128 --no-eager-row"
  SYN="--synthetic-tokenizer $FIELDS --synthetic qwen2.5-7b-q4_k_m"
  for c in 512 4096; do
    step "decode 7b $c" "$R/decode-7b-$c.log" $DEC $SYN --prompt-tokens $c
    step "decode plain attention 7b $c" "$R/decode-plainattn-7b-$c.log" env MINIVLLM_ATTENTION_MMA=0 $DEC $SYN \
      --prompt-tokens $c
  done
  P="python3 scripts/profile_decode_step.py $R/profile $FIELDS"
  step "profile 7b 4096" "$R/profile-4096.log" $P --prompt-tokens 4096 --synthetic qwen2.5-7b-q4_k_m
  step "disaggregation" "$R/disaggregation.log" timeout "${DISAGG_BUDGET:-100}" python3 -m minivllm bench \
    disaggregation --model "$S05" --inference-device cuda:0 --inference-device cpu:8 --prompts 4096 \
    --outputs 128 --backlogs 0 --runs 2
  cat "$R"/profile/*.md > "$OUT/profile.md" 2>/dev/null
elif [ "$MODE" = verify ]; then
  # minivllm alone, one call, after a change of defaults: pytest -m cuda natively (each test
  # named in the log), then issue 43's GPU -> CPU bench with A at its slot cap (8 slots, 8 long
  # answers decoding): whole on A waits for a slot, a split's prefill half takes a handoff row.
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nproc; } > "$R/device.txt" 2>&1
  synthetic qwen2.5-0.5b-q4_k_m > "$W/synthetic.log" 2>&1
  if [ "${NATIVE_PYTEST:-1}" != 0 ]; then
    BUDGET=$(( $(date +%s) - T0 + ${PYTEST_BUDGET:-230} )) step "pytest native" "$R/pytest-cuda-native.log" \
      python3 -m pytest -m cuda -v -n 8 --timeout 90 -p no:cacheprovider -rfE
    stamp "pytest native: $(tail -n 1 "$R/pytest-cuda-native.log")"
  fi
  if [ "${SM75_PYTEST:-0}" != 0 ]; then  # issue 41's T4-profile row, when no run 1 fits the session
    BUDGET=$(( $(date +%s) - T0 + ${PYTEST_BUDGET:-190} )) step "pytest sm75" "$R/pytest-cuda-sm75.log" \
      env MINIVLLM_GPU_PROFILE=sm75 python3 -m pytest -m cuda -v -n 8 --timeout 90 -p no:cacheprovider -rfE
    stamp "pytest sm75: $(tail -n 1 "$R/pytest-cuda-sm75.log")"
  fi
  S05=$(sed -n 1p "$W/synthetic.log")
  [ "${DISAGG:-1}" != 0 ] && step "disaggregation" "$R/disaggregation.log" timeout "${DISAGG_BUDGET:-200}" python3 -m minivllm bench \
    disaggregation --model "$S05" --inference-device cuda:0 --inference-device cpu:8 --prompts ${DISAGG_PROMPTS:-4096,1024} \
    --outputs 128 --backlogs ${DISAGG_BACKLOGS:-8,0} --option max_active_requests=8 --runs ${DISAGG_RUNS:-1} \
    --burst ${DISAGG_BURST:-4}
  # DISAGG_PIN=1: the bench again with the CPU worker on cores of its own (cpu_placement.py)
  [ "${DISAGG_PIN:-0}" != 0 ] && step "disaggregation pinned" "$R/disaggregation-pinned.log" timeout \
    "${DISAGG_BUDGET:-200}" python3 -m minivllm bench disaggregation --model "$S05" --inference-device cuda:0 \
    --inference-device cpu:8 --prompts ${DISAGG_PROMPTS:-4096,1024} --outputs 128 --backlogs ${DISAGG_BACKLOGS:-8,0} \
    --option max_active_requests=8 --runs ${DISAGG_RUNS:-1} --burst ${DISAGG_BURST:-4} --pin-cpus
  # The CPU engine alone with the split's rows, in anonymous and in shared (memfd) pools, and
  # the machine's huge-page settings: is the two-split slowdown the pool's memory?
  { cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/shmem_enabled; lscpu; } \
    > "$R/transparent-hugepages.txt" 2>&1  # and the cores: are 16 CPUs 8 cores' hyperthreads?
  [ "${PROBE:-1}" != 0 ] && step "imported rows probe" "$R/cpu-imported-rows.log" timeout "${PROBE_BUDGET:-150}" \
    python3 scripts/cpu_imported_rows.py "$S05" --context ${DISAGG_PROMPTS%%,*} --threads 8 --neighbours 4,8
  [ "${PROBE:-1}" != 0 ] && step "imported rows probe, pinned" "$R/cpu-imported-rows-pinned.log" timeout \
    "${PROBE_BUDGET:-150}" python3 scripts/cpu_imported_rows.py "$S05" --context ${DISAGG_PROMPTS%%,*} --threads 8 \
    --neighbours 4,8 --pin --skip-base
  grep -E "FAILED|ERROR" "$R"/pytest-cuda-*.log 2>/dev/null | head -20 | tee -a "$R/timeline.txt"
  if [ "${GEMV_STEP:-0}" != 0 ]; then  # the GEMVs' share of copy bandwidth inside a 7B decode step
    # (the file is written only now: writing it beside the bench slowed A's K/V writes 15-25x)
    start_7b_file
    while pgrep -f ensure_synthetic_model > /dev/null; do sleep 2; done
    stamp "7B file: $(sed -n 2p "$W/synthetic.log")"
    P="python3 scripts/profile_decode_step.py $R/profile $FIELDS --synthetic qwen2.5-7b-q4_k_m --prompt-tokens 512"
    step "profile 7b" "$R/profile-7b.log" $P
    step "profile 7b early" "$R/profile-7b-early.log" env MINIVLLM_GEMV_EARLY_LOAD=1 $P
    step "profile 7b int8 gemv" "$R/profile-7b-int8.log" env MINIVLLM_Q8_GEMV=1 $P
    grep -h "GEMV kernels" "$R"/profile/*.md | tee -a "$R/timeline.txt"
    cat "$R"/profile/*.md > "$OUT/profile.md" 2>/dev/null
  fi
elif [ "$MODE" = lean ]; then
  # One short call, minivllm alone, for a session whose device time cannot cover runs 1 and 2.
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nproc; } > "$R/device.txt" 2>&1
  stamp "device: $(head -20 "$R/device.txt" | grep -m1 -o 'NVIDIA [A-Z0-9]*[^|]*')"
  synthetic qwen2.5-0.5b-q4_k_m > "$W/synthetic.log" 2>&1
  start_7b_file
  T=Q4_K,Q6_K,Q8_0,Q5_0
  BUDGET=$(( $(date +%s) - T0 + ${SWEEP_BUDGET:-170} )) step "sweep" "$R/sweep.log" python3 scripts/gemv_sweep.py \
    "$W/sweep" --types $T --quick $T --shapes 3584x3584,fused,3584x18944
  cp "$W"/sweep/* "$R/" 2>/dev/null
  BUDGET=$(( $(date +%s) - T0 + ${NEW_TESTS_BUDGET:-80} )) step "pytest new native" "$R/pytest-cuda-new.log" \
    python3 -m pytest -m cuda -v -n 4 --timeout 120 -p no:cacheprovider -rfE \
    tests/integration/kernels/test_split_fixup.py tests/integration/engine/test_handoff_rows.py
  stamp "pytest new native: $(tail -n 1 "$R/pytest-cuda-new.log")"
  if [ "${SM75:-1}" != 0 ]; then
    BUDGET=$(( $(date +%s) - T0 + 45 )) step "pytest sm75 handoff rows" "$R/pytest-cuda-sm75.log" \
      env MINIVLLM_GPU_PROFILE=sm75 python3 -m pytest -m cuda -v --timeout 120 -p no:cacheprovider -rfE \
      tests/integration/engine/test_handoff_rows.py
    stamp "pytest sm75 handoff rows: $(tail -n 1 "$R/pytest-cuda-sm75.log")"
  fi
  decode_rows_pdl  # 7B at 512 and 4096 tokens, PDL on and off, then the 0.5B
elif [ "$MODE" = quick ]; then
  # minivllm alone, for a session that timed llama.cpp in an earlier call: the GEMV/fold/PDL
  # CUDA tests, then batch-1 decode (PDL off and on) at 512 and 4096 tokens of context.
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nproc; } > "$R/device.txt" 2>&1
  stamp "device: $(head -20 "$R/device.txt" | grep -m1 -o 'NVIDIA [A-Z0-9]*[^|]*')"
  synthetic qwen2.5-0.5b-q4_k_m > "$W/synthetic.log" 2>&1
  start_7b_file
  BUDGET=$(( $(date +%s) - T0 + ${PYTEST_BUDGET:-150} )) step "pytest gemv cuda" "$R/pytest-cuda-gemv.log" python3 -m pytest -q -m cuda \
    -p no:cacheprovider -rfE -x tests/integration/kernels/test_triton_tiled_gemv.py \
    tests/integration/kernels/test_triton_repacked_gemv.py tests/integration/kernels/test_split_sum_fold.py \
    tests/integration/kernels/test_pdl.py tests/integration/kernels/test_fused_projection.py
  stamp "pytest: $(tail -n 1 "$R/pytest-cuda-gemv.log")"
  decode_rows
elif [ "$MODE" = once ]; then
  # Everything that matters most in ONE device call, for a session with too little device
  # time left for runs 1 and 2: the llama.cpp build in the background while the GPU does the
  # attention sweep and the newest CUDA tests, then both engines' batch-1 decode (PDL on and
  # off), the 4096-token context row, and the disaggregation bench if time is left.
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nproc; } > "$R/device.txt" 2>&1
  stamp "device: $(head -20 "$R/device.txt" | grep -m1 -o 'NVIDIA [A-Z0-9]*[^|]*')"
  [ -x "$LLAMA_BIN/llama-bench" ] || setsid nohup bash ../peers/build_on_gpu.sh ../peers/llama.cpp.tar.xz "$W/llama" 90 \
    > "$W/llama-build.log" 2>&1 < /dev/null &
  synthetic qwen2.5-0.5b-q4_k_m > "$W/synthetic.log" 2>&1
  start_7b_file
  if [ "${ATTN_SWEEP:-0}" != 0 ]; then
    BUDGET=$(( $(date +%s) - T0 + 90 )) step "attention sweep" "$R/attention-sweep.log" \
      python3 scripts/attention_bench.py "$R/attention-sweep.json" --sweep --batches 1,8 --contexts 512,4096
  fi
  # The newest CUDA tests (the PDL bits test builds three engines: about 3 minutes cold)
  BUDGET=$(( $(date +%s) - T0 + ${NEW_TESTS_BUDGET:-240} )) step "pytest new cuda" "$R/pytest-cuda-new.log" python3 -m pytest -q -m cuda \
    -p no:cacheprovider -rfE --durations 5 ${NEW_TESTS:-tests/integration/kernels/test_pdl.py tests/integration/engine/test_handoff_cuda.py}
  stamp "pytest: $(tail -n 1 "$R/pytest-cuda-new.log")"
  decode_rows_pdl  # minivllm's rows while llama.cpp builds; llama-bench's on the same files once it is built
  while pgrep -f build_on_gpu.sh > /dev/null && [ "$(left)" -gt 45 ]; do sleep 3; done
  stamp "llama.cpp: $(ls "$LLAMA_BIN" 2>/dev/null | grep -c llama-) binaries; $(tail -n 1 "$W/llama-build.log")"
  step "llama-bench 7b" "$R/llama-bench-7b.log" bash -c "'$LLAMA_BIN/llama-bench' -m '$S7' -ngl 99 -p 512 -n 128 \
    -d 0,512,4096 -r 3 -o json > '$R/llama-bench-7b.json'"
  step "llama-bench 0.5b" "$R/llama-bench-0.5b.log" bash -c "'$LLAMA_BIN/llama-bench' -m '$S05' -ngl 99 -p 512 \
    -n 128 -d 0,512 -r 3 -o json > '$R/llama-bench-0.5b.json'"
  if [ "${DISAGG:-0}" != 0 ]; then
    step "disaggregation" "$R/disaggregation.log" python3 -m minivllm bench disaggregation --model "$S05" \
      --inference-device cuda:0 --inference-device cpu:8 --prompts 1024,4096 --outputs 128,512 --backlogs 0,24 --runs 1
  fi
elif [ "$MODE" = early-ab ]; then
  source "$HERE/scripts/gpu_early_ab.sh"
elif [ "$MODE" = 1 ]; then
  { nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nproc; } > "$R/device.txt" 2>&1
  stamp "device: $(head -20 "$R/device.txt" | grep -m1 -o 'NVIDIA [A-Z0-9]*[^|]*')"
  if [ ! -x "$LLAMA_BIN/llama-batched-bench" ]; then
    setsid nohup nice -n 15 bash ../peers/build_on_gpu.sh ../peers/llama.cpp.tar.xz "$W/llama" 90 \
      > "$W/llama-build.log" 2>&1 < /dev/null &
    stamp "llama.cpp build started (background)"
  fi
  synthetic qwen2.5-0.5b-q4_k_m > "$W/synthetic.log" 2>&1  # first: the CUDA tests' fallback model
  setsid nohup nice -n 10 bash -c "python3 -c \"
from minivllm.bench.synthetic_model import ensure_synthetic_model as e
print(e('qwen2.5-7b-q4_k_m', tokenizer_source='$FIELDS', progress=False), flush=True)
\"" >> "$W/synthetic.log" 2>&1 < /dev/null &
  stamp "0.5B file written; 7B file started (background)"
  if [ "${SWEEP:-1}" != 0 ]; then  # the 7B o/fused/down, then the 0.5B shapes, PDL on; run 2 uses the table
    T=Q4_K,Q6_K,Q8_0,Q5_0
    BUDGET=${SWEEP_BUDGET:-200} step "sweep" "$R/sweep.log" python3 scripts/gemv_sweep.py "$W/sweep" --types $T \
      --quick $T --shapes 3584x3584,fused,3584x18944,0.5b
    stamp "sweep rows: $(grep -c '^Q' "$R/sweep.log")"
    cp "$W"/sweep/* "$R/" 2>/dev/null
    # (the sweep with the weights asked of L2 before the PDL wait ran until h100-s51: slower; dropped)
  fi
  # the newest GPU tests natively
  BUDGET=$(( $(date +%s) - T0 + ${NEW_TESTS_BUDGET:-90} )) step "pytest new native" "$R/pytest-cuda-new.log" \
    python3 -m pytest -m cuda -v -n 4 --timeout 120 -p no:cacheprovider -rfE \
    tests/integration/kernels/test_pdl.py \
    tests/integration/kernels/test_triton_tiled_gemv.py tests/integration/engine/test_handoff_rows.py
  stamp "pytest new native: $(tail -n 1 "$R/pytest-cuda-new.log")"
  # pytest -m cuda in the T4 profile (each test named; the native profile runs in `verify`)
  BUDGET=$(( $(date +%s) - T0 + ${PYTEST_BUDGET:-220} )) step "pytest sm75" "$R/pytest-cuda-sm75.log" \
    env MINIVLLM_GPU_PROFILE=sm75 python3 -m pytest -m cuda -v -n 8 --timeout 300 -p no:cacheprovider -rfE
  stamp "pytest sm75: $(tail -n 1 "$R/pytest-cuda-sm75.log")"
  BASE=""; [ -f ../paged_attention_b738059.py ] && BASE="--baseline-module ../paged_attention_b738059.py"
  BUDGET=$(( $(date +%s) - T0 + ${ATTN_BUDGET:-70} )) step "attention bench" "$R/attention-bench.log" \
    python3 scripts/attention_bench.py "$R/attention-bench.json" $BASE
  BUDGET=$(( $(date +%s) - T0 + ${ATTN_SWEEP_BUDGET:-75} )) step "attention sweep" "$R/attention-sweep.log" \
    python3 scripts/attention_bench.py "$R/attention-sweep.json" --sweep --sweep-only --batches 1,8
  if [ "${DISAGG:-1}" != 0 ]; then  # issue 43: prefill on the GPU, decode on 8 of the CPU cores, K/V moved
    S05=$(sed -n 1p "$W/synthetic.log")
    step "disaggregation" "$R/disaggregation.log" timeout "${DISAGG_BUDGET:-200}" python3 -m minivllm bench \
      disaggregation --model "$S05" --inference-device cuda:0 --inference-device cpu:8 --prompts 1024,4096 \
      --outputs 128,512 --backlogs 0,24 --runs 1
    stamp "disaggregation: $(grep -m1 -o 'Link: .*' "$R/disaggregation.log" | head -c 300)"
  fi
  stamp "llama build: $(tail -n 2 "$W/llama-build.log" | tr '\n' ' ')"
  stamp "synthetic: $(tr '\n' ' ' < "$W/synthetic.log" | tail -c 300)"
else
  export MINIVLLM_GEMV_CONFIGS=$W/sweep/gemv_configs.json
  [ -f "$MINIVLLM_GEMV_CONFIGS" ] || unset MINIVLLM_GEMV_CONFIGS
  stamp "GEMV table: ${MINIVLLM_GEMV_CONFIGS:-the committed one}"
  if [ ! -x "$LLAMA_BIN/llama-batched-bench" ] && ! pgrep -f build_on_gpu.sh > /dev/null; then
    stamp "no llama.cpp build here (a fresh machine?): building now"
    bash ../peers/build_on_gpu.sh ../peers/llama.cpp.tar.xz "$W/llama" 90 > "$W/llama-build.log" 2>&1
  fi
  while pgrep -f ensure_synthetic_model > /dev/null; do sleep 3; done  # run 1's writer, if still going
  S05=$(synthetic qwen2.5-0.5b-q4_k_m | tail -n 1); S7=$(synthetic qwen2.5-7b-q4_k_m | tail -n 1)
  stamp "files: $S05 $S7"
  while pgrep -f build_on_gpu.sh > /dev/null; do sleep 5; done
  stamp "llama.cpp: $(ls "$LLAMA_BIN" 2>/dev/null | tr '\n' ' ')"
  DEC="python3 -m minivllm bench decode --activation-dtype f16 --inference-device cuda:0 --runs 3 --max-runs 3 --max-tokens 128 --no-eager-row"
  SYN="--synthetic-tokenizer $FIELDS --synthetic"
  for s in qwen2.5-0.5b-q4_k_m qwen2.5-7b-q4_k_m; do
    step "decode $s (+ llama-bench)" "$R/decode-$s.log" \
      $DEC $SYN $s --prompt-tokens 512 --llama-bench "$LLAMA_BIN/llama-bench"
  done
  # the defaults since s49 turned off one at a time (the plain attention body; PDL), then the GEMV's
  # first trip loaded before its PDL wait (MINIVLLM_GEMV_EARLY_LOAD=1; opt-in until measured)
  for s in qwen2.5-0.5b-q4_k_m qwen2.5-7b-q4_k_m; do
    step "decode plain attention $s" "$R/decode-plainattn-$s.log" env MINIVLLM_ATTENTION_MMA=0 $DEC $SYN $s \
      --prompt-tokens 512
    step "decode early $s" "$R/decode-early-$s.log" env MINIVLLM_GEMV_EARLY_LOAD=1 $DEC $SYN $s \
      --prompt-tokens 512
  done
  step "decode no pdl 7b" "$R/decode-nopdl-qwen2.5-7b-q4_k_m.log" env MINIVLLM_PDL=0 $DEC $SYN qwen2.5-7b-q4_k_m \
    --prompt-tokens 512
  step "batched early 7b" "$R/batched-early-7b.log" env MINIVLLM_GEMV_EARLY_LOAD=1 python3 \
    scripts/gpu_batched_decode.py "$S7" "$R/batched-early-7b.json" --npl 1,8,32
  step "batched 0.5b (bench offline --llama-batched-bench)" "$R/batched-0.5b.log" \
    python3 -m minivllm bench offline --model "$S05" --llama-batched-bench "$LLAMA_BIN/llama-batched-bench"
  step "batched 7b (bench offline --llama-batched-bench)" "$R/batched-7b.log" \
    python3 -m minivllm bench offline --model "$S7" --llama-batched-bench "$LLAMA_BIN/llama-batched-bench"
  # the int8 GEMV (opt-in natively): minivllm only, batch 1 (INT8=1)
  for s in ${INT8:+qwen2.5-0.5b-q4_k_m qwen2.5-7b-q4_k_m}; do
    step "decode int8 $s" "$R/decode-int8-$s.log" env MINIVLLM_Q8_GEMV=1 $DEC $SYN $s --prompt-tokens 512
  done
  # decode after 4096 tokens of context (7B): minivllm, then llama-bench -d 0,512,4096
  step "decode 7b after 4096" "$R/decode-7b-4096.log" $DEC $SYN qwen2.5-7b-q4_k_m --prompt-tokens 4096
  step "decode plain attention 7b after 4096" "$R/decode-plainattn-7b-4096.log" env MINIVLLM_ATTENTION_MMA=0 $DEC \
    $SYN qwen2.5-7b-q4_k_m --prompt-tokens 4096
  echo "$LLAMA_BIN/llama-bench -m $S7 -ngl 99 -p 0 -n 128 -d 0,512,4096 -r 3 -o json" > "$R/llama-bench-7b-depth.cmd"
  step "llama-bench depth" "$R/llama-bench-7b-depth.log" bash -c "'$LLAMA_BIN/llama-bench' -m '$S7' -ngl 99 -p 0 \
    -n 128 -d 0,512,4096 -r 3 -o json > '$R/llama-bench-7b-depth.json'"
  # the T4 profile on this GPU, and batch-invariant mode's cost (batch 1 and 8)
  for s in qwen2.5-0.5b-q4_k_m qwen2.5-7b-q4_k_m; do
    step "decode T4 profile $s" "$R/decode-sm75-$s.log" env MINIVLLM_GPU_PROFILE=sm75 $DEC $SYN $s --prompt-tokens 512
  done
  step "batched invariant 0.5b" "$R/batched-invariant-0.5b.log" python3 scripts/gpu_batched_decode.py "$S05" \
    "$R/batched-invariant-0.5b.json" --npl 1,8 --option batch_invariant=true
  step "batched default 0.5b (1, 8)" "$R/batched-default-0.5b.log" python3 scripts/gpu_batched_decode.py "$S05" \
    "$R/batched-default-0.5b.json" --npl 1,8
  # host overhead (HOST=1; measured in s48): the same decode with async scheduling off (every step read
  # before the next), and with the split-K sums launched on their own instead of folded into the next norm
  for s in ${HOST:+qwen2.5-0.5b-q4_k_m qwen2.5-7b-q4_k_m}; do
    step "decode sync $s" "$R/decode-sync-$s.log" $DEC $SYN $s --prompt-tokens 512 --option async_scheduling=false
    step "decode unfolded $s" "$R/decode-unfolded-$s.log" env MINIVLLM_FOLD_SPLIT_SUM=0 $DEC $SYN $s \
      --prompt-tokens 512
    step "decode eager prefill $s" "$R/decode-eagerprefill-$s.log" $DEC $SYN $s --prompt-tokens 512 \
      --option prefill_graphs=false
  done
  # where a step's time goes now (kernels, calls per step, GPU idle between steps)
  P="python3 scripts/profile_decode_step.py $R/profile $FIELDS"
  step "profile graphs 512" "$R/profile-graphs.log" $P --prompt-tokens 512
  step "profile graphs 8 rows" "$R/profile-8rows.log" $P --prompt-tokens 128 --rows 8
  step "profile early 512" "$R/profile-early.log" env MINIVLLM_GEMV_EARLY_LOAD=1 $P --prompt-tokens 512 \
    --synthetic qwen2.5-7b-q4_k_m
  step "profile prefill 512" "$R/profile-prefill.log" $P --prompt-tokens 512 --prefill --steps 4
  step "profile 7b 4096" "$R/profile-4096.log" $P --prompt-tokens 4096 --synthetic qwen2.5-7b-q4_k_m
  cat "$R"/profile/*.md > "$OUT/profile.md" 2>/dev/null
  # the GEMV/GEMM crossover from batched decode (Deliver 6): GEMV vs dequantize+GEMM per N
  for f in ${THRESHOLD_FILES:-$S7}; do
    step "gemv threshold $(basename "$f")" "$R/gemv-threshold-$(basename "$f" .gguf).log" python3 -m minivllm bench \
      gemv-threshold --model "$f" --inference-device cuda:0 --activation-dtype f16 --concurrency 1,2,4,8,16,32 \
      --max-tokens 32 --runs 2 --max-runs 2
  done
fi
stamp "done"
tar czf "$OUT/run$MODE.tgz" -C "$W" "res$MODE"
cp "$R/timeline.txt" "$OUT/run$MODE-summary.txt"
case "$MODE" in 1|lean) cp "$R"/gemv-sweep-*.md "$OUT/" 2>/dev/null ;; early-ab) cp "$R"/early*-gemv-sweep-*.md "$OUT/" 2>/dev/null ;; esac
exit 0
