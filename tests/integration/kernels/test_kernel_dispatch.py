"""GEMV/GEMM dispatch as a user sees it: options, what ran, memory, bad input.

References are independent of the code under test: the file's own tensor sizes for
memory, the row counts the scheduler is known to produce for the path counts, the
Chrome-trace JSON read back with `json` for trace visibility, and the float32 dense
GEMM for the GEMV path's accuracy on the real model.
"""

from __future__ import annotations

import json

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.errors import ConfigError
from minivllm.gguf.reader import GGUFFile

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), device="cpu", dtype="float32", max_model_len=64, progress=False)


def test_weights_stay_in_block_format(llm, smollm2_path):
    gf = GGUFFile(smollm2_path)
    linear_names = [n for n in gf.tensors if n.endswith(".weight") and "norm" not in n]
    file_bytes = sum(gf.tensors[n].nbytes for n in linear_names)
    assert llm.model.weight_bytes() == file_bytes  # the tied LM head shares the embedding's blocks
    assert llm.snapshot()["kernels"]["weight_bytes"] == file_bytes


@pytest.mark.parametrize("field,value", [
    ("gemv_max_rows", -1), ("gemv_max_rows", 2.5), ("dequant_cache", "yes"),
    ("batch_invariant", "true"), ("enforce_eager", 1),
])
def test_bad_kernel_options_name_the_field(llm, field, value):
    with pytest.raises(ConfigError) as err:
        llm.fork(**{field: value})
    assert err.value.field == field and field in str(err.value)


def test_paths_follow_the_threshold_and_show_in_the_snapshot(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = llm.tokenizer.encode("The quick brown fox")
    per_step = 30 * 7 + 1  # seven projections per layer plus the LM head
    for rows, expected in [(0, {"gemm"}), (4096, {"gemv"})]:
        other = llm.fork(gemv_max_rows=rows)
        engine = other.engine
        engine.add_request(prompt, params)
        steps = []
        while engine.has_unfinished():
            engine.step()
            steps.append(engine.snapshot()["last_step"]["kernel_paths"])
        assert all(set(s) == expected and sum(s.values()) == per_step for s in steps), steps
        assert other.snapshot()["kernels"]["gemv_max_rows"] == rows
    inv = llm.fork(batch_invariant=True)
    inv.generate([prompt], params)
    assert set(inv.snapshot()["last_step"]["kernel_paths"]) == {"gemv-invariant"}


def test_fork_shares_weights_but_not_options(llm):
    other = llm.fork(gemv_max_rows=0)
    assert other.model is llm.model and other.engine is not llm.engine
    assert llm.snapshot()["kernels"]["gemv_max_rows"] != 0


def test_trace_names_the_path(llm, tmp_path):
    from minivllm.obs.trace import disable_tracing, enable_tracing, flush_trace

    enable_tracing(tmp_path, nvtx=False)
    try:
        llm.fork(gemv_max_rows=1).generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=2))
        doc = json.loads(flush_trace().read_text())
    finally:
        disable_tracing()
    paths = {e["args"]["path"] for e in doc["traceEvents"] if e.get("cat") == "qmatmul"}
    assert paths == {"gemm", "gemv"}  # a multi-row prefill, then one-row decode steps


def test_gemv_path_stays_close_to_the_float32_gemm(llm):
    # A float32 model's CPU GEMV is float32 too (cpu_gemv.cpp, or the dense f32 GEMV without
    # it): it differs from the f32 GEMM only in summation order, so its logits are within
    # float32 rounding of the GEMM's (the bf16/f16 packs, 1e-2 away, run only when asked for),
    # and its greedy choice agrees wherever the top-2 margin is not a near-tie.
    prompt = llm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    out = {}
    for rows in (0, 4096):
        seen = []
        other = llm.fork(gemv_max_rows=rows)
        other.engine.logits_hook = lambda rid, logits, seen=seen: seen.append(logits.clone())
        other.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        out[rows] = seen
    first_gemm, first_gemv = out[0][0], out[4096][0]  # same history: the prompt only
    rel = float((first_gemv - first_gemm).abs().max() / first_gemm.abs().max())
    assert 0 < rel < 1e-4, rel
    top2 = torch.topk(first_gemm, 2).values
    if float(top2[0] - top2[1]) > 0.1:
        assert int(first_gemm.argmax()) == int(first_gemv.argmax())
