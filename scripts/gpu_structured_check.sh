#!/usr/bin/env bash
# Structured output on a GPU in one run: the CUDA tests of the constrained draw and the
# token-mask kernel, `bench structured` on the synthetic Qwen2.5-0.5B layout, and the step
# timeline (scripts/structured_step_timeline.py). One call on a lent device covers what
# issue 24's GPU row needs.
#
# Stage first, here (README.md, "Testing on a GPU"):
#   WHEELS="gguf platformdirs llguidance" MODELS= scripts/stage_offline_gpu.sh STAGE
# (no model file: the tests write a tiny one, the bench a synthetic Qwen2.5-0.5B layout;
# the whole stage stays far under a device call's 64 MiB)
# and carry STAGE. There, from STAGE/tree:
#   source ../env.sh && bash scripts/gpu_structured_check.sh [OUTDIR]
# OUTDIR (default $OUT, else ./gpu-structured) gets the logs and the bench's JSON and Markdown.
set -uo pipefail

OUTDIR=${1:-${OUT:-gpu-structured}}
FIELDS=${TOKENIZER_FIELDS:-../peers/qwen2.5-tokenizer-fields.json.xz}
mkdir -p "$OUTDIR"
[ -f "$FIELDS" ] || { echo "no Qwen2.5 tokenizer fields at $FIELDS (set TOKENIZER_FIELDS)" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUTDIR/device.txt"

python3 -m pytest -q -m cuda tests/integration/engine/test_structured_output_cuda.py \
  tests/integration/kernels/test_triton_token_mask.py 2>&1 | tee "$OUTDIR/pytest-structured-cuda.log"

before=$(ls benchmarks/results/structured-*-gpu-*.json 2>/dev/null)
python3 -m minivllm bench structured --synthetic qwen2.5-0.5b-q4_k_m --synthetic-tokenizer "$FIELDS" \
  --inference-device gpu --runs 5 2>&1 | tee "$OUTDIR/bench-structured.log"
for f in benchmarks/results/structured-*-gpu-*.json; do
  case "$before" in *"$f"*) ;; *) cp "$f" "${f%.json}.md" "$OUTDIR/" ;; esac
done

python3 scripts/structured_step_timeline.py "$FIELDS" 2>&1 | tee "$OUTDIR/timeline.log"
