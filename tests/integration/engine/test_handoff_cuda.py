"""A request prefilled on a GPU engine and decoded on a CPU engine, the K/V crossing
through the real transports: copied by DMA straight into the CPU engine's reserved pages
(serving/kv_landing.py, its pool a memfd mapped back and host-registered), or through a
shared-memory segment (serving/kv_segment.py): issue 43's GPU→CPU row.

References:
- the pages: what the CPU pool holds for the imported tokens equals the GPU pool's K/V
  converted to the CPU's f32 (exact for f16 and f32 sources), both read back from the
  pools themselves;
- the tokens: the single-sequence reference on the CPU in f32 (tests/single_sequence.py),
  up to its first near-tie. The GPU computed the prompt's K/V and the first token with
  its own kernels, so a token may flip only where the reference's top-2 margin is within
  what f32 rounding between two kernel families can move. The whole request on the GPU
  alone is held to the same rule, so the split is as close to it as two devices allow.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import torch
from conftest import DATA_DIR
from single_sequence import check_greedy, reference_tokens

from minivllm import LLM, SamplingParams
from minivllm.cache.kv_transfer import read_blocks
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.serving.kv_landing import handoff_from_landing, handoff_to_landing
from minivllm.serving.kv_segment import SEGMENT_PREFIX, handoff_from_wire, handoff_to_wire

pytestmark = pytest.mark.cuda
PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]
LEN = 256
NEAR_TIE = 1e-3  # f32 on both sides: different kernels move a logit by far less than this


@pytest.fixture(scope="module")
def cpu_llm(small_gpu_model_path):
    return LLM(str(small_gpu_model_path), device="cpu", dtype="float32", max_model_len=LEN, progress=False)


def engine(llm, **options) -> LLMEngine:
    return LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=LEN, batch_invariant=True, **options))


def run_to_end(e: LLMEngine, rid: str) -> list[int]:
    while e.has_unfinished():
        e.step()
    return e.pop_output(rid).token_ids


def through_segment(a: LLMEngine, b: LLMEngine, rid: str, ids: list[int]):
    handoff = a.export_request(rid)
    name = f"{SEGMENT_PREFIX}test-{uuid.uuid4().hex[:12]}"
    meta = handoff_to_wire(handoff, name)
    a.abort(rid)
    moved = handoff_from_wire(meta, handoff.params)  # views of the segment, copied once into B's pages
    assert not os.path.exists(f"/dev/shm/{name}")  # unlinked once mapped
    return moved


def through_landing(a: LLMEngine, b: LLMEngine, rid: str, ids: list[int]):
    """The landing as it runs by default: the GPU stores into B's mapped pool itself
    (kernels/triton/kv_export.py), with no fallback to the DMA path recorded."""
    from minivllm.kernels import fallbacks

    moved = _landed(a, b, rid, ids)
    assert not fallbacks.failed("kv_export", (str(a.pool.k.device),)), fallbacks.fallbacks()
    return moved


def through_landing_dma(a: LLMEngine, b: LLMEngine, rid: str, ids: list[int]):
    """The landing's DMA path (MINIVLLM_EXPORT_ZERO_COPY=0): gathered on the GPU, then copied."""
    from minivllm.serving.kv_landing import ZERO_COPY_ENV

    os.environ[ZERO_COPY_ENV] = "0"
    try:
        return _landed(a, b, rid, ids)
    finally:
        os.environ.pop(ZERO_COPY_ENV)


def _landed(a: LLMEngine, b: LLMEngine, rid: str, ids: list[int]):
    ps = b.pool.page_size
    landing = {**b.reserve_import(rid, ids[:len(ids) // ps * ps]), "pool": b.pool.shared.describe()}
    handoff = a.export_request(rid, copy=False)  # A's pages, copied once: GPU -> B's pages
    meta = handoff_to_landing(handoff, landing)
    assert meta["landed_tokens"] == len(ids) // ps * ps
    # The link carried the K/V in B's dtype (f32): twice A's bytes from an f16 pool.
    assert meta["link_bytes"] * a.pool.k.element_size() == meta["nbytes"] * b.pool.k.element_size()
    a.abort(rid)
    return handoff_from_landing(meta, handoff.params)


# The float32 case's reference decodes the 0.5B file token by token on the CPU: under
# `pytest -m cuda -n 8` on a 16-core GPU machine it passed the page check and then ran past
# the suite's 90 s (h100-s49's verify run), so this test has its own limit.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", [through_landing, through_landing_dma, through_segment],
                         ids=["landing", "landing-dma", "segment"])
@pytest.mark.parametrize("gpu_dtype", ["float32", "float16"])
def test_gpu_prefill_cpu_decode(small_gpu_model_path, cpu_llm, gpu_dtype, transport):
    gpu_llm = LLM(str(small_gpu_model_path), device="cuda", dtype=gpu_dtype, max_model_len=LEN, progress=False)
    ids = cpu_llm.tokenizer.encode(" ".join(PROMPTS[:4]))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a, b = engine(gpu_llm), engine(cpu_llm, kv_shareable=True)
    rid = a.add_request(ids, params)
    while not a.request_state(rid).output_ids:
        a.step()
    first = list(a.request_state(rid).output_ids)
    original = a.export_request(rid)  # A's K/V as the GPU holds them, read back for the check
    gpu_k, gpu_v = original.kv.k.float().cpu(), original.kv.v.float().cpu()
    assert original.kv.k.is_cuda and original.kv.k.dtype == getattr(torch, gpu_dtype)
    moved = transport(a, b, rid, ids)
    rid_b = b.import_request(moved, request_id=rid)
    b.step()  # admission restores the imported pages
    view = b.request_state(rid_b)
    n = original.kv.n_tokens
    assert n == len(ids) // b.pool.page_size * b.pool.page_size > 0
    on_cpu = read_blocks(b.pool, view.block_table, (ids + first)[:n])
    assert on_cpu.k.dtype == torch.float32
    assert torch.equal(on_cpu.k, gpu_k) and torch.equal(on_cpu.v, gpu_v)
    split_tokens = first + run_to_end(b, rid_b)
    for e in (a, b):  # nothing held but cached-idle pages (the GPU's graph scratch page aside)
        kv = e.snapshot()["kv"]
        assert kv["total_pages"] - kv["available_pages"] <= (1 if e is a else 0)
    if gpu_dtype == "float16":
        return  # f16 K/V are not what an f32 reference computes; the pages above are the check
    want, margins = reference_tokens(cpu_llm.model, cpu_llm.tokenizer, ids, params, max_model_len=LEN)
    alone = engine(gpu_llm)
    whole_gpu = run_to_end(alone, alone.add_request(ids, params))
    flipped_whole = check_greedy(whole_gpu, want, margins, "whole on the GPU", NEAR_TIE)
    flipped_split = check_greedy(split_tokens, want, margins, "GPU prefill, CPU decode", NEAR_TIE)
    print("margins:", [f"{m:.2e}" for m in margins], "flips:", flipped_whole, flipped_split)
    sure = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
    assert split_tokens[:sure] == whole_gpu[:sure] == want[:sure]
    assert sure >= 4, f"the model's margins leave only {sure} tokens to compare; use a prompt with clearer ones"
