"""A split request's K/V written straight into the decode engine's reserved pages
(serving/kv_landing.py, cache/shared_pool_memory.py), in one process: engine B's pool is a
memfd that this process maps back through /proc, as the prefill worker would.

References: the same request served whole by one engine in batch-invariant mode (token for
token); the page arithmetic by hand (which blocks were reserved, written, restored); the
engines' own page invariants (tests/engine_invariants.py) while a reservation is held and
after it ends.
"""

from __future__ import annotations

import json

import pytest
from conftest import DATA_DIR
from engine_invariants import check_invariants, free_equals_total

from minivllm import LLM, SamplingParams
from minivllm.cache.kv_transfer import LandedBlocks
from minivllm.cache.shared_pool_memory import attach, forget_all
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.handoff import Handoff
from minivllm.errors import ConfigError
from minivllm.serving.kv_landing import handoff_from_landing, handoff_to_landing

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    yield LLM(str(smollm2_path), device="cpu", dtype="float32", max_model_len=256, progress=False)
    forget_all()


def engine(llm, **options) -> LLMEngine:
    return LLMEngine(llm.model, llm.tokenizer, EngineConfig(max_model_len=256, batch_invariant=True, **options))


def run(e: LLMEngine, rid: str) -> list[int]:
    while e.has_unfinished():
        e.step()
    return e.pop_output(rid).token_ids


def prefill(a: LLMEngine, prompt_ids, params=GREEDY) -> str:
    rid = a.add_request(prompt_ids, params, request_id="split-1")
    while not a.request_state(rid).output_ids:
        a.step()
    return rid


def land(a: LLMEngine, b: LLMEngine, rid: str, prompt_ids) -> tuple[dict, Handoff]:
    """B reserves pages for the prompt's full pages, A writes into them, B imports."""
    ps = b.pool.page_size
    landing = {**b.reserve_import(rid, prompt_ids[:len(prompt_ids) // ps * ps]), "pool": b.pool.shared.describe()}
    check_invariants(b)  # the reserved pages are accounted for while held
    meta = handoff_to_landing(a.export_request(rid, copy=False), landing)
    a.release(rid)
    handoff = handoff_from_landing(meta, GREEDY)
    return meta, handoff


@pytest.mark.parametrize("page_a,page_b", [(16, 16), (8, 16), (16, 8)])
def test_landed_split_equals_the_whole_request(llm, page_a, page_b):
    prompt_ids = llm.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    ref = engine(llm)
    want = run(ref, ref.add_request(prompt_ids, GREEDY))
    a, b = engine(llm, page_size=page_a), engine(llm, page_size=page_b, kv_shareable=True)
    assert b.pool.shared is not None and a.pool.shared is None
    rid = prefill(a, prompt_ids)
    first = list(a.request_state(rid).output_ids)
    meta, handoff = land(a, b, rid, prompt_ids)
    # By hand: A holds floor(L / page_a) full pages; B reserved floor(L / page_b) blocks; what
    # lands is the B blocks inside A's full pages, all of them written (B had none cached).
    full_a = len(prompt_ids) // page_a * page_a
    blocks = min(len(prompt_ids) // page_b, full_a // page_b)
    assert meta["landed"] == blocks > 0 and meta["landed_tokens"] == blocks * page_b
    assert meta["nbytes"] == meta["landed_tokens"] * 30 * 3 * 64 * 4 * 2  # SmolLM2: layers, KV heads, dim, f32, K+V
    assert meta["link_bytes"] == meta["nbytes"]  # both pools f32: the link carries the bytes as they are
    b.import_request(handoff, request_id=rid)
    out = b.output(rid)
    assert first + run(b, rid) == want
    assert out.metrics.cached_prompt_tokens == blocks * page_b  # restored from the landed pages, not recomputed
    free_equals_total(b)


def test_blocks_the_decode_engine_has_cached_are_not_written(llm):
    prompt_ids = llm.tokenizer.encode(PROMPTS[2] + " " + PROMPTS[3])
    a, b = engine(llm), engine(llm, kv_shareable=True)
    run(b, b.add_request(prompt_ids, GREEDY))  # B computed (and cached) this prompt itself
    rid = prefill(a, prompt_ids)
    first = list(a.request_state(rid).output_ids)
    ps = b.pool.page_size
    reserved = b.reserve_import(rid, prompt_ids[:len(prompt_ids) // ps * ps])
    assert reserved["have"] == len(prompt_ids) // ps and reserved["pages"] == []
    b.drop_reservation(rid)
    meta, handoff = land(a, b, rid, prompt_ids)
    assert meta["landed_tokens"] == 0 and meta["nbytes"] == 0
    b.import_request(handoff, request_id=rid)
    ref = engine(llm)
    want = run(ref, ref.add_request(prompt_ids, GREEDY))
    assert first + run(b, rid) == want
    free_equals_total(b)


def test_a_burst_of_landings_sharing_a_prefix_restores_every_block(llm):
    # Two splits whose prompts share their first pages (a system prompt), both reserved on B
    # before either lands, as in a burst: each reservation then holds a copy of the shared
    # blocks. The second landing must hold the first's indexed copies in place of its own,
    # or its chain ends at the first shared block and B recomputes all the rest.
    ps = 16
    shared = llm.tokenizer.encode(" ".join(PROMPTS[:3]))[:2 * ps]  # two full pages in common
    prompts = [shared + llm.tokenizer.encode(" " + " ".join(PROMPTS[i:i + 4])) for i in (3, 7)]
    assert all(len(p) >= 4 * ps for p in prompts)  # blocks of their own past the shared ones
    a, b = engine(llm, page_size=ps), engine(llm, page_size=ps, kv_shareable=True)
    landings, rids, firsts = [], [], []
    for i, prompt_ids in enumerate(prompts):
        rid = a.add_request(prompt_ids, GREEDY, request_id=f"burst-{i}")
        landings.append({**b.reserve_import(rid, prompt_ids[:len(prompt_ids) // ps * ps]),
                         "pool": b.pool.shared.describe()})
        rids.append(rid)
    assert [landing["have"] for landing in landings] == [0, 0]  # neither knew of the other's pages
    while not all(a.request_state(rid).output_ids for rid in rids):
        a.step()
    for rid, prompt_ids, landing in zip(rids, prompts, landings):
        firsts.append(list(a.request_state(rid).output_ids))
        meta = handoff_to_landing(a.export_request(rid, copy=False), landing)
        a.release(rid)
        assert meta["landed"] == len(prompt_ids) // ps  # B had none cached when it reserved
        b.import_request(handoff_from_landing(meta, GREEDY), request_id=rid)
        check_invariants(b)
    outs = [b.output(rid) for rid in rids]
    while b.has_unfinished():
        b.step()
    for rid, prompt_ids, first, out in zip(rids, prompts, firsts, outs):
        assert out.metrics.cached_prompt_tokens == len(prompt_ids) // ps * ps  # every block, none recomputed
        ref = engine(llm)
        assert first + b.pop_output(rid).token_ids == run(ref, ref.add_request(prompt_ids, GREEDY))
    free_equals_total(b)


def test_a_reservation_given_back_or_bypassed_leaves_no_page(llm):
    prompt_ids = llm.tokenizer.encode(PROMPTS[4] + " " + PROMPTS[6])
    b = engine(llm, kv_shareable=True)
    ps = b.pool.page_size
    ids = prompt_ids[:len(prompt_ids) // ps * ps]
    assert len(b.reserve_import("r", ids)["pages"]) == len(ids) // ps > 0
    assert b.snapshot()["kv"]["free_pages"] == b.pool.num_pages - len(ids) // ps
    assert b.drop_reservation("r") and not b.drop_reservation("r")  # idempotent
    free_equals_total(b)
    # A reservation whose K/V then come as plain tensors (the segment path) is given back
    # before those are adopted.
    a = engine(llm)
    rid = prefill(a, prompt_ids)
    b.reserve_import(rid, ids)
    handoff = a.export_request(rid)
    a.release(rid)
    b.import_request(handoff, request_id=rid)
    check_invariants(b)
    run(b, rid)
    free_equals_total(b)


def test_landed_blocks_for_another_prefix_are_refused_and_the_pages_freed(llm):
    prompt_ids = llm.tokenizer.encode(PROMPTS[5] + " " + PROMPTS[7])
    a, b = engine(llm), engine(llm, kv_shareable=True)
    rid = prefill(a, prompt_ids)
    _, handoff = land(a, b, rid, prompt_ids)
    wrong = Handoff(handoff.prompt_ids, handoff.output_ids, GREEDY,
                    LandedBlocks([t + 1 for t in handoff.kv.token_ids], handoff.kv.blocks), None, None)
    with pytest.raises(ConfigError, match="another prefix"):
        b.import_request(wrong, request_id=rid)
    with pytest.raises(ConfigError, match="no pages were reserved"):
        b.import_request(handoff, request_id=rid)  # the refusal gave the reservation back
    free_equals_total(b)


def test_the_pool_maps_back_through_proc_and_a_gone_owner_is_refused(llm):
    b = engine(llm, kv_shareable=True)
    k, v = attach(b.pool.shared.describe())
    k[0, 0, 0, 0, 0] = 7.0  # the same memory as B's pool, not a copy
    assert float(b.pool.k[0, 0, 0, 0, 0]) == 7.0 and v.shape == b.pool.v.shape
    desc = dict(b.pool.shared.describe(), inode=0)  # an fd that now names another file
    with pytest.raises(FileNotFoundError, match="gone"):
        attach(desc)


def test_a_prefetch_maps_the_pool_once_in_the_background(llm, monkeypatch):
    """`prefetch` (what the prefill worker does at a split request's submit): the pool is
    mapped by one background thread however often it is asked, the writer's `attach`
    then finds that mapping (the same tensors), and a prefetch of a gone pool leaves
    nothing behind for `attach` to return."""
    import threading

    from minivllm.cache import shared_pool_memory as spm

    forget_all()
    b = engine(llm, kv_shareable=True)
    desc = b.pool.shared.describe()
    made, release = [], threading.Event()
    real = spm._Attached

    def slow(*args):  # a registration that takes a while: every prefetch meanwhile is a no-op
        release.wait(5)
        made.append(1)
        return real(*args)

    monkeypatch.setattr(spm, "_Attached", slow)
    for _ in range(3):
        spm.prefetch(desc)
    release.set()
    k, _ = attach(desc)  # waits for the prefetch's mapping instead of making another
    assert made == [1] and k.data_ptr() == attach(desc)[0].data_ptr()
    for t in [t for t in threading.enumerate() if t.name == "kv-pool-prefetch"]:
        t.join(5)  # attach returns once the mapping exists, maybe before the thread's own bookkeeping
    assert not spm._prefetching
    spm.prefetch(dict(desc, inode=0))  # gone: the thread ends, nothing is cached
    for t in [t for t in threading.enumerate() if t.name == "kv-pool-prefetch"]:
        t.join(5)
    assert not spm._prefetching and spm._key(dict(desc, inode=0)) not in spm._attached
    forget_all()


@pytest.mark.parametrize("layers_a_gather", [1, 2, 3], ids=["one-layer", "two-then-one", "all"])
def test_gather_layers_lands_each_page_in_its_reserved_page_converted(layers_a_gather, monkeypatch):
    """The GPU exporter's gather (kv_landing.gather_layers), run on CPU tensors: source
    pages in any order, destination pages in runs with gaps, f16 into f32, one, two (then
    the last one) or all three layers a gather. Each destination page must hold its source
    page, every other page stays untouched."""
    import torch

    from minivllm.serving import kv_landing
    from minivllm.serving.kv_landing import gather_layers

    gen = torch.Generator().manual_seed(7)
    layers, shape = 3, (4, 2, 8)  # (page size, heads, head dim)
    src = [torch.randn(layers, 10, *shape, generator=gen).half() for _ in range(2)]
    dst = [torch.full((layers, 12, *shape), -7.0) for _ in range(2)]
    src_pages, dst_pages = [9, 2, 5, 0, 7], [3, 4, 5, 8, 11]  # runs 3-5, 8, 11
    layer_bytes = len(src_pages) * 4 * 2 * 8 * 4  # the pages of one layer, in float32
    monkeypatch.setattr(kv_landing, "GATHER_BYTES", layers_a_gather * layer_bytes + layer_bytes // 2)
    gather_layers(src_pages, dst_pages, src, dst)
    for s_pool, d_pool in zip(src, dst):
        for layer in range(layers):
            for s, d in zip(src_pages, dst_pages):
                assert torch.equal(d_pool[layer, d], s_pool[layer, s].float())
            for untouched in set(range(12)) - set(dst_pages):
                assert (d_pool[layer, untouched] == -7.0).all()
