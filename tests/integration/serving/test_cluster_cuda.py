"""A CPU worker and GPU workers in one cluster (device machine only; skipped elsewhere).

Each worker's greedy output is compared with the in-process engine on the same device
and settings (batch-invariant on both sides), so a GPU worker that ran on the wrong
device, or a transport that dropped or reordered tokens, fails here.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.engine.llm import LLM
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving import Cluster

pytestmark = pytest.mark.cuda

OPTIONS = {"max_model_len": 512, "batch_invariant": True}
PROMPT = "The three most useful things to know about GPUs are"


def test_cpu_and_gpu_workers_each_match_their_device_reference(smollm2_path):
    n_gpu = torch.cuda.device_count()
    devices = ["cpu:2"] + ["gpu"] * n_gpu
    params = SamplingParams(temperature=0, max_tokens=24)
    with Cluster(str(smollm2_path), devices, router="round-robin", **OPTIONS) as cluster:
        names = list(cluster.workers)
        assert names == ["cpu"] + [f"cuda:{i}" for i in range(n_gpu)]  # gpu claims 0, 1, ... in order
        streams = {name: cluster.submit(PROMPT, params, worker=name) for name in names}
        outputs = {name: s.result(timeout=120) for name, s in streams.items()}
        snap = cluster.snapshot()
    for w in snap["workers"]:
        assert w["snapshot"]["engine"]["device"] == ("cpu" if w["name"] == "cpu" else w["name"])
        assert w["rates"]["prefill_tps"] > 0 and w["rates"]["decode_tps"]["1"] > 0
    for name, out in outputs.items():
        ref = LLM(str(smollm2_path), device="cpu" if name == "cpu" else name, progress=False, **OPTIONS)
        want = ref.generate(PROMPT, params)[0]
        assert out.token_ids == want.token_ids, name
        assert out.text == want.text


def test_cost_router_prefers_the_gpu_for_a_long_prompt(smollm2_path):
    # A ~350-token uncached prompt: prefill dominates, and a GPU prefills far faster than
    # two CPU threads, whatever the exact calibrated rates are.
    with Cluster(str(smollm2_path), ["cpu:2", "gpu"], router="cost", **OPTIONS) as cluster:
        prompt = " ".join(f"item{i}" for i in range(100))
        stream = cluster.submit(prompt, SamplingParams(temperature=0, max_tokens=4))
        stream.result(timeout=120)
        decision = stream.decision
        scores = {c["worker"]: c["score"] for c in decision["candidates"]}
        assert decision["chosen"] == "cuda:0" and scores["cuda:0"] < scores["cpu"], decision
