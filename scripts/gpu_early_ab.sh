# The `early-ab` mode of scripts/gpu_vs_llama_cpp.sh, sourced by it (its functions step,
# stamp, left, synthetic, start_7b_file and its variables R, W, FIELDS are in scope): one call,
# minivllm alone, for the latest A/Bs. Knobs: EARLY_VALUES (GEMV trips loaded before the PDL
# wait, default "0 1"), DECODE_ROWS, DECODE_05, MERGE_AB, QKV_AB, EXPORT_BENCH, DISAGG, BACKLOGS, BURST, DMA_AB,
# GEMV_ROW / ROW_EARLY / ROW_TYPES, INVARIANT_AB, MULTIROW_AB, NEW_TESTS / NEW_TESTS_BUDGET / NEW_TESTS_K, BUILD_LLAMA, SWEEP_TYPES / SWEEP_SHAPES / SWEEP_BUDGET.
# minivllm alone: the GEMV's first trip loaded before its PDL wait (the default since h100-s57)
# against after it (MINIVLLM_GEMV_EARLY_LOAD=0), 7B at 512 and 4096 tokens, 0.5B at 512; issue
# 43's burst (the export on a stream of its own); then, with the time left, GEMV sweeps of
# SWEEP_SHAPES without and with the early first trip. (Until h100-s57 it also timed the
# attention's K/V asked of L2 before its wait: level at 512, 1% slower at 4096; removed.)
{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"; nproc; } > "$R/device.txt" 2>&1
stamp "device: $(head -20 "$R/device.txt" | grep -m1 -o 'NVIDIA [A-Z0-9]*[^|]*')"
synthetic qwen2.5-0.5b-q4_k_m > "$W/synthetic.log" 2>&1
start_7b_file
# The newest CUDA tests first (while the 7B file is written), when NEW_TESTS_BUDGET asks: the
# pass/fail of what the timings below run matters more than any timing. NEW_TESTS_K: pytest -k.
if [ "${NEW_TESTS_BUDGET:-0}" -gt 0 ]; then  # the CUDA tests also run in `once`
  BUDGET=$(( $(date +%s) - T0 + NEW_TESTS_BUDGET )) step "pytest new cuda" "$R/pytest-cuda-new.log" \
    python3 -m pytest -q -m cuda -n 4 --timeout 300 -p no:cacheprovider -rfE --durations 8 \
    ${NEW_TESTS_K:+-k "$NEW_TESTS_K"} ${NEW_TESTS:-tests/integration/kernels/test_pdl.py tests/integration/engine/test_handoff_cuda.py}
  stamp "pytest: $(tail -n 1 "$R/pytest-cuda-new.log")"
fi
while pgrep -f ensure_synthetic_model > /dev/null; do sleep 2; done
S05=$(sed -n 1p "$W/synthetic.log")
DEC="python3 -m minivllm bench decode --activation-dtype f16 --inference-device cuda:0 --runs 3 --max-runs 3 --max-tokens 128 --no-eager-row"
SYN="--synthetic-tokenizer $FIELDS --synthetic"
[ "${DECODE_ROWS:-1}" = 0 ] && EARLY_DECODE="" || EARLY_DECODE=${EARLY_VALUES:-0 1}
for e in $EARLY_DECODE; do  # EARLY_VALUES=1: the default alone (one call for everything); DECODE_ROWS=0: none
  for c in 512 4096; do
    step "decode 7b $c early=$e" "$R/decode-early$e-7b-$c.log" env MINIVLLM_GEMV_EARLY_LOAD=$e $DEC $SYN \
      qwen2.5-7b-q4_k_m --prompt-tokens $c
  done
  [ "${DECODE_05:-1}" != 0 ] && step "decode 0.5b early=$e" "$R/decode-early$e-0.5b.log" \
    env MINIVLLM_GEMV_EARLY_LOAD=$e $DEC $SYN qwen2.5-0.5b-q4_k_m --prompt-tokens 512
done
# issue 41's GEMV row as a decode step launches each 7B role (bench/gemv_row.py: the committed
# config, PDL, ROW_EARLY trips before the wait; a read-only kernel of the same bytes beside)
[ "${GEMV_ROW:-1}" != 0 ] && step "gemv row" "$R/gemv-row.log" python3 -m minivllm bench kernels --row \
  --early "${ROW_EARLY:-1,0,2}" $([ -n "${ROW_TYPES:-}" ] && echo --types "$ROW_TYPES")
# batch-invariant mode's cost at 8 rows (the tiled GEMV per row; since h100-s59 a tile's rows are
# launched side by side, tiled_gemv.tile_and_row), against the default batch on the same file
if [ "${INVARIANT_AB:-1}" != 0 ]; then
  step "batched invariant 0.5b" "$R/batched-invariant-0.5b.log" python3 scripts/gpu_batched_decode.py "$S05" \
    "$R/batched-invariant-0.5b.json" --npl 1,8 --option batch_invariant=true
  step "batched default 0.5b (1, 8)" "$R/batched-default-0.5b.log" python3 scripts/gpu_batched_decode.py "$S05" \
    "$R/batched-default-0.5b.json" --npl 1,8
fi
# MULTIROW_AB=1: steps of up to 8 rows on the GEMV path (gemv_max_rows=8), which since h100-s59 takes
# kernels/triton/multirow_gemv.py (each weight tile decoded once for the rows), against the default
# (the dense f16 GEMM over the dequantized weights), 0.5B and 7B at 8 sequences
if [ "${MULTIROW_AB:-1}" != 0 ]; then
  S7=$(sed -n 2p "$W/synthetic.log")
  for f in "$S05:0.5b" "$S7:7b"; do
    step "batched multirow ${f##*:}" "$R/batched-multirow-${f##*:}.log" python3 scripts/gpu_batched_decode.py \
      "${f%:*}" "$R/batched-multirow-${f##*:}.json" --npl 8 --option gemv_max_rows=8
    step "batched gemm ${f##*:}" "$R/batched-gemm-${f##*:}.log" python3 scripts/gpu_batched_decode.py \
      "${f%:*}" "$R/batched-gemm-${f##*:}.json" --npl 8
  done
fi
# the merge over the whole head, one program per (row, head), as until h100-s57 (the default
# splits a head's dims over programs of 32: paged_attention._MERGE_DIMS)
if [ "${MERGE_AB:-0}" != 0 ]; then  # decided at h100-s58 (the split dims won); MERGE_AB=1 times it again
  for c in 512 4096; do
    step "decode 7b $c whole-head merge" "$R/decode-merge0-7b-$c.log" env MINIVLLM_MERGE_DIMS=0 $DEC $SYN \
      qwen2.5-7b-q4_k_m --prompt-tokens $c
  done
fi
# the fused QKV's split sum folded into RoPE (opt-in: it lost at h100-s58)
if [ "${QKV_AB:-0}" != 0 ]; then
  step "decode 7b 512 qkv sum folded" "$R/decode-qkv1-7b-512.log" env MINIVLLM_FOLD_QKV_SUM=1 $DEC $SYN \
    qwen2.5-7b-q4_k_m --prompt-tokens 512
  step "decode 0.5b qkv sum folded" "$R/decode-qkv1-0.5b.log" env MINIVLLM_FOLD_QKV_SUM=1 $DEC $SYN \
    qwen2.5-0.5b-q4_k_m --prompt-tokens 512
fi
# issue 43's transfer row alone: the DMA path and the zero-copy kernel against a pinned copy_,
# idle and with the default stream busy (scripts/export_bench.py; seconds each)
if [ "${EXPORT_BENCH:-1}" != 0 ]; then
  step "export bench" "$R/export-bench.log" python3 scripts/export_bench.py "$R/export-bench.json"
  step "export bench busy" "$R/export-bench-busy.log" python3 scripts/export_bench.py "$R/export-bench-busy.json" --busy
  step "export bench 7b" "$R/export-bench-7b.log" python3 scripts/export_bench.py "$R/export-bench-7b.json" --shape 7B
fi
# issue 43: the split with A idle (the bench takes the link's rate from that row) and under a
# backlog of 8, the GPU storing the pages into B's pool (kernels/triton/kv_export.py, the default
# since h100-s59); BACKLOGS picks the backlogs, BURST the burst
[ "${DISAGG:-1}" != 0 ] && step "disaggregation" "$R/disaggregation.log" python3 -m minivllm bench \
  disaggregation --model "$S05" --inference-device cuda:0 --inference-device cpu:8 --prompts 4096 \
  --outputs 128 --backlogs "${BACKLOGS:-0,8}" --option max_active_requests=8 --runs 2 \
  $([ "${BURST:-4}" != 0 ] && echo --burst "${BURST:-4}")
# DMA_AB=1: the same bench by the DMA path (MINIVLLM_EXPORT_ZERO_COPY=0: gathered on the GPU, then copied)
[ "${DMA_AB:-0}" != 0 ] && step "disaggregation dma" "$R/disaggregation-dma.log" \
  env MINIVLLM_EXPORT_ZERO_COPY=0 python3 -m minivllm bench disaggregation --model "$S05" --inference-device cuda:0 \
  --inference-device cpu:8 --prompts 4096 --outputs 128 --backlogs "${BACKLOGS:-0,8}" \
  --option max_active_requests=8 --runs 2
# the GEMV at 7B shapes without and with its first trip loaded before the wait (the sweep's graphs
# chain their launches with PDL, as a decode step does), half the time left each
# BUILD_LLAMA=1: llama.cpp builds from here on (niced, after the decode rows), so a `once` call
# on the same warm machine finds it built
if [ "${BUILD_LLAMA:-0}" != 0 ] && [ ! -x "$LLAMA_BIN/llama-bench" ]; then
  setsid nohup nice -n 15 bash ../peers/build_on_gpu.sh ../peers/llama.cpp.tar.xz "$W/llama" 90 \
    > "$W/llama-build.log" 2>&1 < /dev/null &
  stamp "llama.cpp build started (background)"
fi
T=${SWEEP_TYPES:-Q4_K,Q6_K}
EV=(${EARLY_VALUES:-0 1}); n_left=${#EV[@]}
for e in "${EV[@]}"; do  # an equal share of the time left each (0, 1 or 2 trips before the wait)
  SB=$(( ($(left) - 10) / n_left )); n_left=$(( n_left - 1 )); [ "$SB" -gt "${SWEEP_BUDGET:-150}" ] && SB=${SWEEP_BUDGET:-150}
  BUDGET=$(( $(date +%s) - T0 + SB )) step "sweep early=$e" "$R/sweep-early$e.log" \
    env MINIVLLM_GEMV_EARLY_LOAD=$e python3 scripts/gemv_sweep.py "$W/sweep-early$e" --types $T --quick $T \
    --shapes ${SWEEP_SHAPES:-3584x3584,3584x18944}
  for f in "$W/sweep-early$e"/gemv-sweep-*; do [ -f "$f" ] && cp "$f" "$R/early$e-$(basename "$f")"; done
done
