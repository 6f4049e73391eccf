#!/usr/bin/env bash
# Stage this project for a GPU machine without network: copy into DEST everything a run
# there needs, so that DEST (or the folder it is carried to) holds
#
#   tree/     the working tree: tracked files plus untracked ones git does not ignore
#   wheels/   wheels of the pure-Python dependencies a bare CUDA image lacks ($WHEELS)
#   cache/    the model files of $MODELS from the model cache, laid out as MINIVLLM_CACHE expects
#   peers/    llama.cpp's trimmed sources and build_on_gpu.sh, when $PEERS_DIR has them
#   env.sh    the environment for the run, with paths relative to itself
#
# Usage (here, with network):
#   scripts/stage_offline_gpu.sh DEST
#     MODELS="smollm2-135m qwen2.5-coder-0.5b"  registered names in the model cache (default smollm2-135m; empty: none)
#     WHEELS="gguf platformdirs"                packages to download as wheels (pip download --no-deps)
#     PEERS_DIR=../shared/peers/llama-cpp-cuda  where llama.cpp.tar.xz and build_on_gpu.sh are (optional)
#     PYTHON=.venv/bin/python                   the interpreter whose pip downloads the wheels
#
# Then, on the GPU machine (see README.md, "Testing on a GPU"):
#   cd DEST && source env.sh && cd tree
#   python3 -m pytest -q -m cuda                                    # the CUDA tests (what `make test-gpu` runs)
#   python3 -m minivllm bench all --quick --inference-device cuda:0 --only decode,kernels
#   bash ../peers/build_on_gpu.sh ../peers/llama.cpp.tar.xz ../llama 90   # llama-bench, sm_90
#
# The tree's commit travels in env.sh as MINIVLLM_COMMIT, since a copied .git may be stale.
set -euo pipefail

DEST=${1:?usage: scripts/stage_offline_gpu.sh DEST}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODELS=${MODELS-smollm2-135m}  # MODELS= (empty) stages none
WHEELS=${WHEELS:-gguf platformdirs}
PEERS_DIR=${PEERS_DIR:-$ROOT/../shared/peers/llama-cpp-cuda}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
CACHE=$("$PYTHON" -c "from minivllm.models.cache import cache_dir; print(cache_dir())" 2>/dev/null \
        || echo "${MINIVLLM_CACHE:-$HOME/.cache/minivllm}")

mkdir -p "$DEST"/tree "$DEST"/wheels "$DEST"/cache/models
DEST=$(cd "$DEST" && pwd)

echo "stage: tree -> $DEST/tree"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -C "$DEST/tree" -xf -

echo "stage: wheels ($WHEELS) -> $DEST/wheels"
# shellcheck disable=SC2086  # a word list on purpose
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$DEST/wheels" $WHEELS

for m in $MODELS; do
  if [ -d "$CACHE/models/$m" ]; then
    echo "stage: model $m -> $DEST/cache/models/$m"
    cp -r "$CACHE/models/$m" "$DEST/cache/models/"
  else
    echo "stage: model $m is not in $CACHE/models (download it first: minivllm models pull $m)" >&2
    exit 1
  fi
done

if [ -f "$PEERS_DIR/llama.cpp.tar.xz" ]; then
  echo "stage: llama.cpp peer -> $DEST/peers"
  mkdir -p "$DEST/peers"
  cp "$PEERS_DIR/llama.cpp.tar.xz" "$PEERS_DIR/build_on_gpu.sh" "$DEST/peers/"
  [ -f "$PEERS_DIR/../qwen2.5-tokenizer-fields.json.xz" ] && cp "$PEERS_DIR/../qwen2.5-tokenizer-fields.json.xz" "$DEST/peers/"
else
  echo "stage: no llama.cpp peer sources in $PEERS_DIR (skipped; set PEERS_DIR)"
fi

COMMIT=$(cd "$ROOT" && git rev-parse --short HEAD)$(cd "$ROOT" && [ -z "$(git status --porcelain --untracked-files=no)" ] || echo -dirty)
cat > "$DEST/env.sh" <<ENV
# Source on the GPU machine: installs the staged wheels once, then sets the offline environment.
HERE=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
[ -d "\$HERE/site" ] || python3 -m pip install -q --no-index --no-deps --target "\$HERE/site" "\$HERE"/wheels/*.whl
export PYTHONPATH="\$HERE/site:\$HERE/tree:\$HERE/tree/widgets" PYTHONUNBUFFERED=1 MINIVLLM_CACHE="\$HERE/cache" MINIVLLM_OFFLINE=1 \\
       MINIVLLM_TEST_SKIP_MISSING_MODELS=1 HF_HUB_OFFLINE=1 MINIVLLM_COMMIT=$COMMIT
unset TRITON_INTERPRET
ENV
echo "stage: done; $(du -sh "$DEST" | cut -f1) in $DEST (commit $COMMIT)"
