# Sourced by the scripts/gpu_issue*.sh stage scripts on the GPU box (no network): the
# environment they share, the start marker for "results written since", and $d, where
# the assembled SmolLM2 file goes.
export PYTHONPATH=/root/site:$PWD PYTHONUNBUFFERED=1 MINIVLLM_CACHE=/root/mcache MINIVLLM_OFFLINE=1 \
       MINIVLLM_TEST_SKIP_MISSING_MODELS=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
touch /tmp/start-marker
d=$MINIVLLM_CACHE/models/smollm2-135m; mkdir -p "$d" /root/gpu
