#!/usr/bin/env bash
# `make test-portability`: the suite under the conditions that broke it on machines other
# than the developers' (issue 18): a different number of cores, one OpenMP thread, and the
# other CPU kernel paths torch and MKL can take on this processor.
#
#   one-core      the whole suite under `taskset -c 0` (every worker and thread on one core)
#   omp-1         the whole suite with OMP_NUM_THREADS=1 / MKL_NUM_THREADS=1
#   cpu-<cap>     the numerics tests (`-m numerics`) with torch's kernels dispatched to each
#                 other capability this CPU supports (ATEN_CPU_CAPABILITY), MKL held to the
#                 matching instruction set (MKL_ENABLE_INSTRUCTIONS) and minivllm's compiled
#                 CPU GEMV built for AVX2 (MINIVLLM_CPU_GEMV_ISA) or replaced by torch
#                 (MINIVLLM_CPU_GEMV=torch) for the scalar path
#
# Usage: scripts/test_portability.sh VENV_PYTHON [VARIANT ...]   (default: every variant)
# Each variant's pytest log and a summary table go to $PORTABILITY_DIR (default
# .portability/). The exit status is non-zero when any variant failed.
set -uo pipefail
PY=${1:?usage: test_portability.sh VENV_PYTHON [VARIANT ...]}
shift
OUT=${PORTABILITY_DIR:-.portability}
mkdir -p "$OUT"

native=$("$PY" -c "import torch; print(torch.backends.cpu.get_cpu_capability())")
caps=()
case "$native" in
  AVX512) caps=(avx2 default) ;;
  AVX2) caps=(default) ;;
  *) caps=() ;;  # already the scalar path (or another architecture): nothing lower to try
esac

variants=("$@")
if [ ${#variants[@]} -eq 0 ]; then
  variants=(one-core omp-1)
  for c in "${caps[@]}"; do variants+=("cpu-$c"); done
fi

summary="$OUT/summary.md"
{
  echo "# test-portability on $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores, torch native capability $native"
  echo
  echo "| variant | command | result | wall s |"
  echo "|---|---|---|---|"
} > "$summary"

status=0
for v in "${variants[@]}"; do
  case "$v" in
    one-core) cmd=(taskset -c 0 "$PY" -m pytest -q -p no:cacheprovider) ;;
    omp-1) cmd=(env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$PY" -m pytest -q -p no:cacheprovider) ;;
    cpu-*)
      cap=${v#cpu-}
      # minivllm's compiled f32 GEMV follows too: its AVX2 build, or the pure-torch path.
      if [ "$cap" = avx2 ]; then own=(MKL_ENABLE_INSTRUCTIONS=AVX2 MINIVLLM_CPU_GEMV_ISA=avx2)
      else own=(MKL_ENABLE_INSTRUCTIONS=SSE4_2 MINIVLLM_CPU_GEMV=torch); fi
      cmd=(env ATEN_CPU_CAPABILITY="$cap" "${own[@]}" "$PY" -m pytest -q -p no:cacheprovider -m numerics) ;;
    *) echo "unknown variant $v (one-core, omp-1, cpu-avx2, cpu-default)" >&2; exit 2 ;;
  esac
  echo "== $v: ${cmd[*]}"
  start=$(date +%s)
  "${cmd[@]}" > "$OUT/$v.log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - start ))
  result=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$OUT/$v.log" | tail -1 | tr -d '=' | xargs)
  echo "   rc=$rc  $result  (${wall} s)"
  echo "| $v | \`${cmd[*]}\` | ${result:-rc=$rc} | $wall |" >> "$summary"
  [ $rc -eq 0 ] || status=1
done
echo
cat "$summary"
exit $status
