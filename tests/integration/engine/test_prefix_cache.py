"""The prefix cache (cache/prefix_index.py) and single-flight (cache/flight_coordinator.py).

References, per test (never outputs the engine recorded from itself):

* the single-sequence path — `DecoderModel.forward` over a `ContiguousKVCache`, one
  request alone, plus the sampler with a fresh seeded generator (`reference_tokens`,
  the same construction test_engine.py pins to transformers). A greedy token that
  differs from it is tolerated only after a near-tie of the reference (top-2 logit
  margin < NEAR_TIE): restored K/V were computed in another batch, so f32 rounding may
  differ in the last bits;
* the same workload with the prefix cache (and single-flight) off, in batch-invariant
  mode, where restored K/V must give bit-identical tokens;
* hand-computed expectations: how many tokens a lookup can restore (full pages of all
  prompt tokens but the last), which pages are shared, who waits for whom;
* the bookkeeping checker tests/engine_invariants.py, which recomputes page ownership
  from scratch (block tables + one reference per indexed page) after every step.

Most engine tests run on the tiny synthetic model (fast); the cache-on-vs-off equality
runs on SmolLM2-135M. Everything is f32 on the CPU.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import single_sequence
import torch
from conftest import DATA_DIR
from engine_invariants import check_invariants, free_equals_total
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import event as note_event
from hypothesis import strategies as st

import minivllm.cache.prefix_index as prefix_index_module
from minivllm import LLM, SamplingParams
from minivllm.cache.flight_coordinator import FlightCoordinator, UnknownFlightRequestError
from minivllm.cache.page_pool import PagePool
from minivllm.cache.prefix_index import ROOT_KEY, PrefixIndex
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.request import Status
from minivllm.errors import ConfigError
from minivllm.kernels.kernel_options import KernelOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = json.loads((DATA_DIR / "prompts.json").read_text())["prompts"]
NEAR_TIE = 1e-4  # top-2 logit margin below which a flipped greedy token is tolerated
TINY_LEN = 64  # max_model_len of tiny-model engines
EOS_FREE = st.integers(0, 508)  # the tiny vocabulary's EOS ids are 509 and 511


# -- fixtures and helpers ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny synthetic Llama of test_engine.py (2 layers, d_model 64, vocab 512)."""
    from synthetic_gguf import write_tiny_model

    from minivllm.gguf.reader import GGUFFile
    from minivllm.gguf.tokenizer import Tokenizer
    from minivllm.model.loader import load_model

    path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", n_layers=2, d_model=64, d_ff=128,
                            n_heads=4, n_kv_heads=2, vocab_size=512, context_length=256, seed=3)
    gguf = GGUFFile(path)
    model = load_model(gguf, torch.device("cpu"), torch.float32, progress=False,
                       kernel_options=KernelOptions(gemv_max_rows=0))
    return model, Tokenizer.from_gguf(gguf)


def page_bytes(model, page_size: int) -> int:
    c = model.config
    return PagePool.page_bytes(n_layers=c.n_layers, page_size=page_size, n_kv_heads=c.n_kv_heads,
                               head_dim=c.head_dim, dtype=model.dtype)


def tiny_engine(tiny, *, pages: int | None = None, **config) -> LLMEngine:
    """An engine over the tiny model; `pages` sizes the KV pool exactly."""
    model, tokenizer = tiny
    config.setdefault("max_model_len", TINY_LEN)
    config.setdefault("gemv_max_rows", 0)  # dense f32 GEMM, like the reference
    config.setdefault("page_size", 4)
    if pages is not None:
        config["kv_memory_bytes"] = pages * page_bytes(model, config["page_size"])
    engine = LLMEngine(model, tokenizer, EngineConfig(**config))
    if pages is not None:
        assert engine.pool.num_pages == pages
    return engine


def reference_tokens(model, tokenizer, ids: list[int], params: SamplingParams,
                     max_model_len: int = TINY_LEN) -> tuple[list[int], list[float]]:
    """single_sequence.reference_tokens on the plain f32 GEMM path (not batch-invariant mode)."""
    return single_sequence.reference_tokens(model, tokenizer, ids, params, max_model_len=max_model_len,
                                            kernel_options=KernelOptions(gemv_max_rows=0))


def check_greedy(got: list[int], want: list[int], margins: list[float], label: str) -> int | None:
    return single_sequence.check_greedy(got, want, margins, label, NEAR_TIE)


def check_output(tiny, engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams) -> list[int]:
    """A finished (stop/length) greedy or seeded request against the single-sequence reference."""
    model, tokenizer = tiny
    out = engine.output(rid)
    assert out.finish_reason in ("stop", "length"), (rid, out.finish_reason, engine.request_state(rid).error)
    want, margins = reference_tokens(model, tokenizer, ids, params)
    # Greedy or seeded: the reference's tokens up to its first near-tie. Restored K/V were
    # computed in another batch than this path's, so an exact match past a near-tie draw
    # would test this CPU's rounding, not the cache.
    assert params.greedy or params.seed is not None
    check_greedy(out.token_ids, want, margins, rid)
    return out.token_ids


def check_twins(tiny, engine: LLMEngine, a: str, b: str, ids: list[int], params: SamplingParams) -> None:
    """Two requests of one prompt, one of them restoring the other's pages: each against the
    single-sequence reference (check_output), and the same tokens up to the reference's first
    near-tie. Not beyond it: outside batch-invariant mode, restored K/V and recomputed K/V
    come from different batches, and which way a near-tie falls is this CPU's rounding."""
    got_a, got_b = check_output(tiny, engine, a, ids, params), check_output(tiny, engine, b, ids, params)
    _, margins = reference_tokens(*tiny, ids, params)
    sure = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))
    assert got_a[:sure] == got_b[:sure], (got_a, got_b, sure)


def step(engine: LLMEngine) -> list:
    events = engine.step()
    check_invariants(engine)
    return events


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> int:
    """Step (checking invariants) until nothing is unfinished; returns the steps taken."""
    for n in range(max_steps):
        if not engine.has_unfinished():
            return n
        step(engine)
    raise AssertionError(f"no progress within {max_steps} steps: {engine.snapshot()['queues']}")


def prompt(seed: int, n: int) -> list[int]:
    """n pseudo-random token ids (never EOS); different seeds give different first tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 509, (n,), generator=g).tolist()
    ids[0] = seed % 509
    return ids


def rows_of(engine: LLMEngine) -> dict[str, dict]:
    snap = engine.snapshot()["queues"]
    return {d["id"]: d for name in ("waiting", "preempted", "running") for d in snap[name]}


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


# -- 1: key chaining and collisions (PrefixIndex alone) --------------------------------------------


def small_index(num_pages: int = 8, page_size: int = 2) -> tuple[PagePool, PrefixIndex]:
    pool = PagePool(n_layers=1, num_pages=num_pages, page_size=page_size, n_kv_heads=1, head_dim=2,
                    dtype=torch.float32, device="cpu")
    return pool, PrefixIndex(pool)


def cache_sequence(pool: PagePool, index: PrefixIndex, tokens: list[int]) -> list[int]:
    """What a finished request leaves behind: its full blocks published, its own
    references dropped (deepest first), so the pages are cached-idle. Returns its pages."""
    n = len(tokens) // pool.page_size
    table = pool.allocate(n)
    index.publish(tokens, index.keys_for(tokens, []), table, 0, n)
    pool.release(table[::-1])
    return table


def lookup(index: PrefixIndex, tokens: list[int]) -> list[int]:
    return [b.page for b in index.match(tokens, index.keys_for(tokens, []))]


def test_same_tokens_after_different_parents_get_different_keys():
    """Reference: block i's content is (its whole prefix); a page of [3, 4] computed after
    [8, 9] must never be served for [3, 4] after [1, 2]."""
    pool, index = small_index()
    x = [8, 9, 3, 4]
    w = [1, 2, 5, 6]
    y = [1, 2, 3, 4]
    kx, kw, ky = (index.keys_for(t, []) for t in (x, w, y))
    assert kx[1] != ky[1] and kw[0] == ky[0] and kx[0] != ky[0]
    px = cache_sequence(pool, index, x)
    pw = cache_sequence(pool, index, w)
    assert index.snapshot()["cached_pages"] == 4 and pool.num_free == 4
    assert lookup(index, y) == [pw[0]]  # only [1, 2] is shared; x's [3, 4] page is not
    assert lookup(index, x) == px and lookup(index, w) == pw
    assert lookup(index, [3, 4, 8, 9]) == []  # x's blocks in another order: nothing
    assert lookup(index, [8, 9, 3]) == [px[0]]  # only full blocks ever match
    # A hit shares the page: one reference for the index, one for the new user.
    pages = index.acquire(index.match(y, index.keys_for(y, [])))
    assert pages == [pw[0]] and pool.refcount[pw[0]] == 2 and index.num_idle == 3
    assert index.counters["hits"] == 1 and index.counters["restored_tokens"] == 2


def test_a_forced_hash_collision_is_a_miss_never_a_wrong_hit(monkeypatch):
    """Reference: the tokens themselves. With every chain key forced equal, a lookup may
    only return a block whose tokens *and* parent equal the query's."""
    monkeypatch.setattr(prefix_index_module, "chain_key", lambda parent, tokens: 12345)
    pool, index = small_index()
    x = [8, 9, 3, 4]
    px = cache_sequence(pool, index, x)
    # The second block collides with the first (same key): it is not indexed over it.
    assert index.counters["published_pages"] == 1 and index.counters["duplicate_pages"] == 1
    assert index.snapshot()["cached_pages"] == 1 and pool.num_free == 7
    assert lookup(index, [1, 2, 3, 4]) == []  # same key, other tokens: a miss
    assert lookup(index, [3, 4, 8, 9]) == []
    assert lookup(index, x) == [px[0]]  # the first block really is x's
    # [8, 9, 8, 9]: block 1's key and tokens equal the cached block's, but its parent is
    # not the root: only the parent check stands between this and a wrong hit.
    assert lookup(index, [8, 9, 8, 9]) == [px[0]]


def test_collisions_in_the_engine_still_give_the_reference_tokens(tiny, monkeypatch):
    """Reference: the single-sequence path. Every chain key forced equal: different
    prompts restore nothing, a repeated prompt restores at most its first block."""
    monkeypatch.setattr(prefix_index_module, "chain_key", lambda parent, tokens: 777)
    engine = tiny_engine(tiny, page_size=4, max_batched_tokens=64)
    a, b = prompt(11, 14), prompt(12, 14)
    ra = engine.add_request(a, GREEDY)
    run_to_end(engine)
    rb = engine.add_request(b, GREEDY)
    run_to_end(engine)
    assert engine.request_state(rb).restored_tokens == 0
    ra2 = engine.add_request(a, GREEDY)
    run_to_end(engine)
    assert engine.request_state(ra2).restored_tokens == 4
    for rid, ids in ((ra, a), (rb, b), (ra2, a)):
        check_output(tiny, engine, rid, ids, GREEDY)
    free_equals_total(engine)


# -- 2: cache on or off, the same tokens (SmolLM2, batch-invariant) ----------------------------


SMOL_LEN = 256


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return LLM(str(smollm2_path), device="cpu", dtype="float32", max_model_len=SMOL_LEN, progress=False,
               kv_memory_bytes=4 << 20, batch_invariant=True)


def shared_document_workload(smol, **config) -> tuple[LLMEngine, list[list[int]], list[int]]:
    """5 requests = one 104-token document + a question, two questions repeated,
    submitted at steps 0, 0, 1, 2 and 4; greedy, 12 tokens each; 64-token step budget.
    Returns the engine, every request's tokens and restored token counts."""
    tok = smol.tokenizer
    doc = tok.encode(" ".join(PROMPTS[:7]))
    questions = ["\nQuestion: who lived there?", "\nQuestion: what is the capital of Italy?",
                 "\nQuestion: who lived there?", "\nSummary:", "\nQuestion: what is the capital of Italy?"]
    at_step = [0, 0, 1, 2, 4]
    engine = LLMEngine(smol.model, smol.tokenizer, EngineConfig(
        max_model_len=SMOL_LEN, page_size=16, max_batched_tokens=64, batch_invariant=True, **config))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [doc + tok.encode(q) for q in questions]
    rids: list[str] = []
    steps = 0
    while len(rids) < len(prompts) or engine.has_unfinished():
        while len(rids) < len(prompts) and at_step[len(rids)] <= steps:
            rids.append(engine.add_request(prompts[len(rids)], params))
        step(engine)
        steps += 1
        assert steps < 200
    outs = [engine.output(r).token_ids for r in rids]
    for r in rids:
        assert engine.output(r).finish_reason in ("stop", "length")
    return engine, outs, [engine.request_state(r).restored_tokens for r in rids]


@pytest.fixture(scope="module")
def without_cache(smol):
    return shared_document_workload(smol, prefix_cache=False)


@pytest.mark.parametrize("config", [dict(prefix_cache=True), dict(prefix_cache=True, single_flight="after_prefill")],
                         ids=["cache", "cache+single-flight"])
def test_outputs_are_identical_with_the_cache_on_or_off(smol, without_cache, config):
    """Reference: the same workload with prefix_cache=False, batch-invariant: restored
    pages must give bit-for-bit the K/V the request would have computed itself, so the
    tokens are identical. (This needs the invariant attention to ignore the page layout:
    see test_invariant_logits_do_not_depend_on_page_layout.)"""
    off_engine, want, off_restored = without_cache
    assert off_engine.snapshot()["prefix_cache"]["enabled"] is False and off_restored == [0] * 5
    engine, got, restored = shared_document_workload(smol, **config)
    assert got == want
    pc = engine.snapshot()["prefix_cache"]
    # Not vacuous: later requests really restored the document's pages. Request 1 is
    # admitted in step 2 and finds the 4 pages request 0 computed in step 1 (published
    # mid-prefill: incremental publication); the others restore at least the document's
    # 6 full pages.
    assert restored[0] == 0 and restored[1] == 64 and min(restored[2:]) >= 96, restored
    assert pc["restored_tokens"] == sum(restored) and pc["hits"] == 4
    if "single_flight" in config:
        assert pc["flight_counters"]["followers"] >= 1 and pc["flight_counters"]["released_followers"] >= 1
    free_equals_total(engine)


def test_invariant_logits_do_not_depend_on_page_layout(tiny):
    """The premise of the test above, without the prefix cache: batch_invariant=True
    promises a row's arithmetic independent of what else runs. Reference: the same greedy
    request alone (its pages one consecutive run) vs beside a second request, whose
    decode pages interleave with its own (several runs): logits must be bit-identical."""
    def logits_of(ids, others):
        engine = tiny_engine(tiny, page_size=4, batch_invariant=True, prefix_cache=False)
        seen: dict[str, list[torch.Tensor]] = {}
        engine.logits_hook = lambda rid, logits: seen.setdefault(rid, []).append(logits.clone())
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        rid = engine.add_request(ids, params)
        for other in others:
            engine.add_request(other, params)
        fragmented = False
        while engine.has_unfinished():
            step(engine)
            table = engine.request_state(rid).block_table
            fragmented |= any(b != a + 1 for a, b in zip(table, table[1:]))
        return seen[rid], fragmented

    alone, alone_fragmented = logits_of(prompt(140, 10), [])
    beside, beside_fragmented = logits_of(prompt(140, 10), [prompt(141, 10)])
    assert not alone_fragmented and beside_fragmented  # the setup does what it says
    assert len(alone) == len(beside) == 20
    assert all(torch.equal(a, b) for a, b in zip(alone, beside)), \
        max(float((a - b).abs().max()) for a, b in zip(alone, beside))


# -- 3: random programs with heavy prompt reuse (hypothesis) ---------------------------------------


reuse_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.0, 0.0, 0.9]),
    top_k=st.sampled_from([0, 20]),
    seed=st.one_of(st.none(), st.integers(0, 1000)),
    max_tokens=st.integers(1, 10),
    ignore_eos=st.booleans(),
)


def test_random_reuse_programs_keep_pages_consistent(tiny):
    """Random submit/abort/step programs over small pools (eviction and preemption),
    where most prompts repeat or extend earlier ones, under every single_flight setting
    and both publications. References: engine_invariants.check_invariants after every
    operation (refcounts recomputed from block tables + index), free_equals_total at the
    end, and the single-sequence reference for every greedy or seeded request that
    finished. Across the examples, hits, evictions, followers and preemptions must all
    have happened (else the programs are too tame to mean much)."""
    model, tokenizer = tiny
    seen: Counter = Counter()
    # Unseeded sampled requests draw from torch's global generator, so without this the
    # programs (when EOS comes, hence what is live to abort) depend on which tests ran
    # before: the coverage check below then passed alone and failed in the full suite.
    torch.manual_seed(1234)

    # Derandomized: CI sees the same programs every run (see test_engine.py).
    @settings(max_examples=20, deadline=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def program(data):
        page_size = data.draw(st.sampled_from([2, 3, 4, 8]), label="page_size")
        num_pages = max(3, data.draw(st.integers(12, 48), label="pool tokens") // page_size)
        engine = tiny_engine(
            tiny, page_size=page_size, pages=num_pages,
            max_batched_tokens=data.draw(st.integers(1, 24), label="max_batched_tokens"),
            max_active_requests=data.draw(st.integers(1, 4), label="max_active_requests"),
            policy=data.draw(st.sampled_from(["fcfs", "shortest-prefill-first", "round-robin"]), label="policy"),
            prefix_cache=True,
            publication=data.draw(st.sampled_from(["incremental", "at_completion"]), label="publication"),
            single_flight=data.draw(st.sampled_from(["off", "at_completion", "after_prefill"]), label="single_flight"))
        docs = [data.draw(st.lists(EOS_FREE, min_size=4, max_size=24), label=f"doc {i}") for i in range(2)]
        submitted: dict[str, tuple[list[int], SamplingParams]] = {}
        aborted: set[str] = set()

        for _ in range(data.draw(st.integers(4, 30), label="operations")):
            op = data.draw(st.sampled_from(["submit", "submit", "submit", "abort", "step", "step"]), label="op")
            if op == "submit":
                bases = docs + [ids for ids, _ in submitted.values()]
                base = bases[data.draw(st.integers(0, 1 << 16), label="base") % len(bases)]
                kind = data.draw(st.sampled_from(["same", "same", "extend", "truncate", "fresh"]), label="kind")
                if kind == "extend":
                    ids = base + data.draw(st.lists(EOS_FREE, min_size=1, max_size=8), label="extra")
                elif kind == "truncate":
                    ids = base[:data.draw(st.integers(1, len(base)), label="keep")]
                elif kind == "fresh":
                    ids = data.draw(st.lists(EOS_FREE, min_size=1, max_size=24), label="fresh")
                else:
                    ids = list(base)
                ids = ids[:40]
                params = data.draw(reuse_params, label="params")
                if engine.pool.pages_for(min(len(ids) + params.max_tokens, TINY_LEN)) <= num_pages:
                    submitted[engine.add_request(ids, params)] = (ids, params)
                else:
                    with pytest.raises(ConfigError) as err:
                        engine.add_request(ids, params)
                    assert err.value.field == "max_tokens"
            elif op == "abort":
                live = sorted(r for r in submitted if engine.request_state(r).status != Status.FINISHED)
                if live:
                    # An index from a fixed range, not sampled_from(live): see test_engine.py.
                    rid = live[data.draw(st.integers(0, 1 << 16), label="abort") % len(live)]
                    event = engine.abort(rid)
                    assert event.finished and event.finish_reason == "abort"
                    assert engine.abort(rid) is None
                    aborted.add(rid)
            else:
                for _ in range(data.draw(st.integers(1, 4), label="steps")):
                    step(engine)
            check_invariants(engine)
            assert min(engine.pool.refcount) >= 0

        for _ in range(1000):
            if not engine.has_unfinished():
                break
            step(engine)
        assert not engine.has_unfinished(), f"no progress: {engine.snapshot()['queues']}"
        pc = engine.snapshot()["prefix_cache"]
        for name, value in (("hits", pc["hits"]), ("evictions", pc["evicted_pages"]),
                            ("preemptions", engine.counters["preemptions"]),
                            ("followers", pc["flight_counters"].get("followers", 0)),
                            ("promotions", pc["flight_counters"].get("promotions", 0))):
            seen[name] += value > 0
            note_event(f"{name} > 0: {value > 0}")
        free_equals_total(engine)

        for rid, (ids, params) in submitted.items():
            if rid in aborted:
                assert engine.output(rid).finish_reason == "abort"
            elif params.greedy or params.seed is not None:
                check_output(tiny, engine, rid, ids, params)
            else:
                assert engine.output(rid).finish_reason in ("stop", "length")

    program()
    # Promotions (a leader cancelled mid-prefill) are not required here: whether a random
    # program hits that window changed between this file alone and the full suite even
    # with the generator seeded. test_cancelling_the_leader_mid_prefill_promotes_the_oldest_follower
    # pins them deterministically; these programs still check invariants when they occur.
    assert all(seen[k] > 0 for k in ("hits", "evictions", "preemptions", "followers")), seen


# -- 4: eviction under pressure never takes a page in use ---------------------------------------


def test_eviction_under_pressure_never_evicts_a_page_in_use(tiny, monkeypatch):
    """The pool is filled with idle cached pages; a running request shares three of them;
    new requests need most of the pool. References: a spy on every eviction (no evicted
    page is in a live block table), the shared pages' refcounts (index + request), and
    the single-sequence reference for every output."""
    ps, pages = 4, 16
    engine = tiny_engine(tiny, page_size=ps, pages=pages, max_batched_tokens=64)
    params5 = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    docs = [prompt(20 + i, 12) for i in range(4)]
    for ids in docs:  # one at a time: each leaves 4 full pages (16 computed tokens) cached
        rid = engine.add_request(ids, params5)
        run_to_end(engine)
        check_output(tiny, engine, rid, ids, params5)
    pc = engine.snapshot()["prefix_cache"]
    assert engine.pool.num_free == 0 and pc["idle_pages"] == pages == pc["cached_pages"]

    evicted_in_use = []
    evict = PrefixIndex.evict

    def spy(index: PrefixIndex, n: int) -> int:
        live = {p for t in engine.kv_ownership()["requests"].values() for p in t}
        before = set(index.page_block)
        done = evict(index, n)
        evicted_in_use.extend((before - set(index.page_block)) & live)
        return done

    monkeypatch.setattr(PrefixIndex, "evict", spy)

    r_ids = docs[0] + [5, 6]
    r_params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    r = engine.add_request(r_ids, r_params)
    step(engine)
    req = engine.request_state(r)
    assert req.restored_tokens == 12
    shared = req.block_table[:3]
    big = [(prompt(40, 28), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)),
           (prompt(41, 16), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))]
    others = []
    n = 0
    while engine.has_unfinished():
        if n < len(big):
            others.append(engine.add_request(*big[n]))
        step(engine)
        n += 1
        if req.status == Status.RUNNING:
            assert req.block_table[:3] == shared
            for p in shared:
                assert p in engine.kv_ownership()["cache"]["pages"] and engine.pool.refcount[p] >= 2
        assert n < 100
    assert engine.snapshot()["prefix_cache"]["evicted_pages"] > 0
    assert req.metrics.preemptions == 0 and evicted_in_use == []
    check_output(tiny, engine, r, r_ids, r_params)
    for rid, (ids, params) in zip(others, big):
        check_output(tiny, engine, rid, ids, params)
    free_equals_total(engine)


def test_a_duplicate_page_never_leaves_a_cached_block_without_its_parent(tiny):
    """Two requests compute the same first page concurrently (no single-flight): the
    second one's copy is a duplicate and stays private, but its *deeper* blocks get
    indexed under the other request's first page, which the second one does not hold.
    When that page is evicted, the deeper blocks are orphans (engine_invariants:
    "a chain is never cut in the middle"). Reference: the invariant checker, and the
    single-sequence path for the tokens."""
    engine = tiny_engine(tiny, page_size=4, pages=10, max_batched_tokens=64)
    doc = prompt(60, 12)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    work = [(doc[:4] + [7], one), (doc + [9], GREEDY)]  # A publishes doc's first block and ends
    rids = [engine.add_request(ids, p) for ids, p in work]
    step(engine)
    assert engine.snapshot()["prefix_cache"]["duplicate_pages"] == 1  # B's copy of that block
    work.append((prompt(61, 20), GREEDY))  # needs pages: evicts A's idle first block
    rids.append(engine.add_request(*work[-1]))
    run_to_end(engine)  # check_invariants after every step
    assert engine.snapshot()["prefix_cache"]["evicted_pages"] > 0
    for rid, (ids, params) in zip(rids, work):
        check_output(tiny, engine, rid, ids, params)
    free_equals_total(engine)


# -- 5: admission counts restored pages once ------------------------------------------------------


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache", "control-no-cache"])
def test_admission_does_not_reserve_restored_pages_again(tiny, prefix_cache):
    """7 pages of 4 tokens; two identical 17-token prompts, 3 tokens each. The first
    takes 5 pages. With the cache the second restores 4 full pages (16 tokens) and needs
    1 more page, so it runs beside the first; without the cache it needs 5 and must wait
    until the first finishes. Reference: that page arithmetic, and the single-sequence
    reference for the tokens."""
    engine = tiny_engine(tiny, page_size=4, pages=7, max_batched_tokens=64, prefix_cache=prefix_cache)
    ids = prompt(70, 17)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    a = engine.add_request(ids, params)
    b = engine.add_request(ids, params)
    ra, rb = engine.request_state(a), engine.request_state(b)
    together = 0
    while engine.has_unfinished():
        step(engine)
        running = [engine.request_state(r) for r in engine.progress()]
        if ra in running and rb in running:
            together += 1
            assert rb.restored_tokens == 16
            assert rows_of(engine)[b]["restored_tokens"] == 16
        if prefix_cache is False:
            assert not (ra in running and rb in running) and rb.restored_tokens == 0
    assert (together > 0) == prefix_cache
    assert engine.counters["preemptions"] == 0
    assert engine.output(b).metrics.cached_prompt_tokens == (16 if prefix_cache else 0)
    check_twins(tiny, engine, a, b, ids, params)
    free_equals_total(engine)


# -- 6: a lookup never restores the whole prompt -------------------------------------------------


@pytest.mark.parametrize("k", [1, 3])
def test_a_page_aligned_repeated_prompt_still_computes_its_last_page(tiny, k):
    """A prompt of exactly k pages, run twice: the second restores k-1 pages (a lookup
    covers all prompt tokens but the last, so there are logits to sample), computes
    the last page itself, and gives the single-sequence reference's tokens."""
    ps = 4
    engine = tiny_engine(tiny, page_size=ps, max_batched_tokens=64)
    ids = prompt(80 + k, k * ps)
    first = engine.add_request(ids, GREEDY)
    run_to_end(engine)
    assert engine.snapshot()["prefix_cache"]["cached_pages"] >= k  # the whole prompt is cached
    second = engine.add_request(ids, GREEDY)
    step(engine)
    assert engine.request_state(second).restored_tokens == (k - 1) * ps
    assert engine.last_step["rows"] == [{"id": second, "phase": "prefill", "tokens": ps, "draft_tokens": 0}]
    assert engine.last_step["logits_rows"] == 1 and len(engine.request_state(second).output_ids) == 1
    run_to_end(engine)
    check_twins(tiny, engine, second, first, ids, GREEDY)
    free_equals_total(engine)


# -- 7: incremental vs at-completion publication ----------------------------------------------------


@pytest.mark.parametrize("n", [14, 16])
@pytest.mark.parametrize("publication", ["incremental", "at_completion"])
def test_publication_policy_decides_what_a_concurrent_twin_restores(tiny, publication, n):
    """A decodes; B (same n-token prompt) arrives after A's first token. Incremental:
    A's prompt pages are already published, B restores floor((n-1)/ps)*ps tokens while A
    still runs. At completion: nothing is published yet, B restores 0."""
    ps = 4
    engine = tiny_engine(tiny, page_size=ps, max_batched_tokens=64, publication=publication)
    ids = prompt(90 + n, n)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    a = engine.add_request(ids, params)
    step(engine)
    assert len(engine.request_state(a).output_ids) == 1
    b = engine.add_request(ids, params)
    step(engine)
    assert engine.request_state(a).status == Status.RUNNING and engine.request_state(b).status == Status.RUNNING
    want = (n - 1) // ps * ps if publication == "incremental" else 0
    assert engine.request_state(b).restored_tokens == want
    run_to_end(engine)
    check_twins(tiny, engine, a, b, ids, params)
    free_equals_total(engine)


# -- 8: single-flight followers ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [14, 16])
@pytest.mark.parametrize("release", ["at_completion", "after_prefill"])
def test_single_flight_followers_restore_the_leaders_prompt(tiny, release, n):
    """4 identical n-token prompts submitted together: the leader computes the prompt,
    the followers wait (not running) until the release — after_prefill: in the step that
    gives the leader its first token, while it then decodes on; at_completion: once it
    finished. At the release each follower samples its first token from the leader's
    prompt logits with its own settings (same step, same TTFT as the release), then holds
    prompt + 1 token, so its lookup (all but the last token) restores the prompt's
    n//ps full pages. Reference: the single-sequence path (greedy, and seeded with each
    follower's own seed: the first draw is from the leader's logits, the rest from its own)."""
    ps = 4
    engine = tiny_engine(tiny, page_size=ps, max_batched_tokens=64, single_flight=release)
    ids = prompt(100 + n, n)
    params = {"leader": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              "greedy": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              "seed1": SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
              "seed2": SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True)}
    rid = {name: engine.add_request(ids, p, request_id=name) for name, p in params.items()}
    leader = engine.request_state("leader")
    followers = ["greedy", "seed1", "seed2"]
    restored = n // ps * ps

    snap = engine.snapshot()
    assert [(f["leader"], f["followers"], f["input_tokens"]) for f in snap["prefix_cache"]["flights"]] == [
        ("leader", followers, n)]
    rows = rows_of(engine)
    assert rows["leader"]["flight"] == "leader" and rows["leader"]["waiting_on"] is None
    assert all(rows[f]["flight"] == "follower" and rows[f]["waiting_on"] == "leader" for f in followers)

    released_at = None
    admitted_at: dict[str, int] = {}
    first_token_at: dict[str, int] = {}
    leader_running_at_admission = []
    for step_no in range(1, 60):
        if not engine.has_unfinished():
            break
        for event in step(engine):
            first_token_at.setdefault(event.request_id, step_no)
        running = set(engine.progress())
        for f in followers:
            if f in running and f not in admitted_at:
                admitted_at[f] = step_no
                assert engine.request_state(f).restored_tokens == restored
                leader_running_at_admission.append(leader.status == Status.RUNNING)
        if released_at is None:
            done = leader.output_ids if release == "after_prefill" else leader.status == Status.FINISHED
            if done:
                released_at = step_no
                rows = rows_of(engine)
                assert all(rows[f]["flight"] == "released" and rows[f]["waiting_on"] is None for f in followers)
                assert all(len(engine.request_state(f).output_ids) == 1 for f in followers)
                assert engine.snapshot()["prefix_cache"]["flights"] == []
            else:
                assert not running & set(followers)
                assert all(not engine.request_state(f).output_ids for f in followers)
                rows = rows_of(engine)
                assert all(rows[f]["waiting_on"] == "leader" for f in followers)
                flights = engine.snapshot()["prefix_cache"]["flights"]
                assert [f["followers"] for f in flights] == [followers]
                assert flights[0]["leader_phase"] == ("prefill" if not leader.output_ids else "decode")
    assert not engine.has_unfinished()
    assert admitted_at == {f: released_at + 1 for f in followers}  # the step after the release
    assert first_token_at == {"leader": 1, **{f: released_at for f in followers}}
    if release == "after_prefill":
        assert released_at == 1 and all(leader_running_at_admission)  # the leader still decodes
    else:
        assert released_at == 8 and not any(leader_running_at_admission)
    assert leader.restored_tokens == 0
    pc = engine.snapshot()["prefix_cache"]
    assert pc["flight_counters"] == {"flights": 1, "followers": 3, "promotions": 0, "released_followers": 3}
    assert pc["released"] == [] and pc["restored_tokens"] == 3 * restored
    out = {name: check_output(tiny, engine, rid[name], ids, p) for name, p in params.items()}
    check_twins(tiny, engine, rid["greedy"], rid["leader"], ids, params["greedy"])
    assert out["seed1"] != out["seed2"]  # own seeds, own tokens
    free_equals_total(engine)


def test_a_follower_released_by_an_aborted_leader_still_reports_its_end(tiny):
    """at_completion: the leader is aborted while it decodes; its prompt is computed, so
    the waiting follower is released and samples its first token from the leader's
    prompt logits — with max_tokens=1 that finishes it at once. Reference: the engine's
    driving contract (engine.py: `while engine.has_unfinished(): for event in
    engine.step()`), under which every request's finished event is seen: abort()
    returns the aborted request's, step() must return the others. `LLMEngine.run` steps only
    while has_unfinished(), so a lost event leaves the follower's consumer waiting forever."""
    engine = tiny_engine(tiny, single_flight="at_completion")
    ids = prompt(130, 10)
    leader = engine.add_request(ids, GREEDY)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    follower = engine.add_request(ids, one)
    step(engine)
    step(engine)
    assert engine.request_state(leader).phase == "decode" and engine.flights.waiting_on(follower) == leader
    seen = {}
    event = engine.abort(leader)
    seen[event.request_id] = event.finish_reason
    check_invariants(engine)
    for _ in range(10):
        if not engine.has_unfinished():
            break
        seen.update({e.request_id: e.finish_reason for e in step(engine) if e.finished})
    assert engine.output(follower).finish_reason in ("length", "stop")
    check_output(tiny, engine, follower, ids, one)
    assert seen == {leader: "abort", follower: engine.output(follower).finish_reason}
    free_equals_total(engine)


# -- 9: cancelling a leader ------------------------------------------------------------------------


@pytest.mark.parametrize("release", ["at_completion", "after_prefill"])
def test_cancelling_the_leader_mid_prefill_promotes_the_oldest_follower(tiny, release):
    """The leader of a 20-token prompt is aborted after 2 of its 5 prefill chunks; a
    waiting follower is aborted too. The oldest remaining follower leads (restoring the 8
    tokens the aborted leader had computed and published), the last one follows it and
    restores the whole prompt's 5 pages; both finish within a bounded number of steps
    with the single-sequence reference's tokens."""
    ps = 4
    engine = tiny_engine(tiny, page_size=ps, max_batched_tokens=4, single_flight=release)
    ids = prompt(110, 20)
    for name in ("leader", "f1", "f2", "f3"):
        engine.add_request(ids, GREEDY, request_id=name)
    step(engine)
    step(engine)
    assert engine.request_state("leader").num_computed == 8 and engine.request_state("leader").phase == "prefill"

    event = engine.abort("f2")  # a waiting follower
    assert event.finished and event.finish_reason == "abort"
    check_invariants(engine)
    assert "f2" not in rows_of(engine) and engine.flights.role("f2") is None
    assert engine.snapshot()["prefix_cache"]["flights"][0]["followers"] == ["f1", "f3"]

    event = engine.abort("leader")
    assert event.finished and event.finish_reason == "abort"
    check_invariants(engine)
    pc = engine.snapshot()["prefix_cache"]
    assert pc["flight_counters"]["promotions"] == 1
    assert [(f["leader"], f["followers"]) for f in pc["flights"]] == [("f1", ["f3"])]
    rows = rows_of(engine)
    assert rows["f1"]["flight"] == "leader" and rows["f1"]["waiting_on"] is None
    assert rows["f3"]["flight"] == "follower" and rows["f3"]["waiting_on"] == "f1"
    assert not engine.request_state("f1").output_ids and not engine.request_state("f3").output_ids

    steps = run_to_end(engine, max_steps=40)
    assert steps < 40
    assert engine.request_state("f1").restored_tokens == 8  # the aborted leader's two full pages
    assert engine.request_state("f3").restored_tokens == 20
    assert engine.output("leader").finish_reason == engine.output("f2").finish_reason == "abort"
    for name in ("f1", "f3"):
        check_output(tiny, engine, name, ids, GREEDY)
    assert engine.snapshot()["prefix_cache"]["flight_counters"]["promotions"] == 1
    free_equals_total(engine)


# -- 10: the coordinator alone ----------------------------------------------------------------------


def test_flight_coordinator_bookkeeping():
    """Reference: the coordinator's documented contract."""
    fc = FlightCoordinator("at_completion")
    with pytest.raises(UnknownFlightRequestError):
        fc.terminated("nobody", prompt_ready=True)
    with pytest.raises(ValueError):
        FlightCoordinator("eventually")

    assert fc.join("a", [1, 2, 3]) is None
    assert fc.join("b", [1, 2, 3]) == "a" and fc.join("c", [1, 2, 3]) == "a"
    assert fc.join("x", [1, 2]) is None  # other input ids: another flight
    with pytest.raises(ValueError):
        fc.join("b", [1, 2, 3])
    assert fc.role("a") == "leader" and fc.role("b") == "follower" and fc.waiting_on("b") == "a"
    assert fc.prefill_done("a") == []  # at_completion: prefill does not release

    assert fc.terminated("a", prompt_ready=True) == ["b", "c"]
    assert fc.released == {"b", "c"} and fc.role("b") == "released" and fc.waiting_on("b") is None
    with pytest.raises(UnknownFlightRequestError):
        fc.terminated("a", prompt_ready=True)  # the leader's end was already reported
    # A new identical request after the release starts a new flight.
    assert fc.join("d", [1, 2, 3]) is None and fc.role("d") == "leader"
    assert fc.join("e", [1, 2, 3]) == "d"
    # Released ids are tracked until they terminate: once works, twice is a bug.
    assert fc.terminated("b", prompt_ready=True) == []
    with pytest.raises(UnknownFlightRequestError):
        fc.terminated("b", prompt_ready=True)
    assert fc.released == {"c"}
    # A leader that ends unpublished hands the flight to its oldest follower.
    assert fc.terminated("d", prompt_ready=False) == ["e"]
    assert fc.role("e") == "leader" and fc.counters["promotions"] == 1
    assert fc.terminated("e", prompt_ready=False) == []  # no followers: the flight just ends
    assert fc.role("e") is None and fc.flights.keys() == {(1, 2)}
    assert fc.terminated("c", prompt_ready=False) == [] and fc.terminated("x", prompt_ready=True) == []
    assert fc.flights == {} and fc.flight_of == {} and fc.released == set()

    ap = FlightCoordinator("after_prefill")
    ap.join("a", [5])
    ap.join("b", [5])
    assert ap.prefill_done("b") == []  # only the leader's prefill counts
    assert ap.prefill_done("a") == ["b"] and ap.role("a") == "released"
    assert ap.terminated("a", prompt_ready=True) == [] and ap.terminated("b", prompt_ready=True) == []
    assert ap.counters == {"flights": 1, "followers": 1, "promotions": 0, "released_followers": 1}


# -- 11: distinct inputs see no change ---------------------------------------------------------------


def test_distinct_prompts_schedule_exactly_as_with_everything_off(tiny):
    """Distinct prompts (distinct first pages), staggered, chunked: with the prefix
    cache and after_prefill single-flight on, every step's schedule and every token are
    exactly those of an engine with both off, no flight ever has followers and nothing
    is restored. Reference: the engine with both off (and the single-sequence path)."""
    def run(**config):
        # batch_invariant: the claim is bit-identity of the scheduling and the tokens; the
        # cache keeps idle pages, so the two engines' requests sit on other pages, and in
        # the default mode attention over non-consecutive pages sums in another order.
        engine = tiny_engine(tiny, page_size=4, pages=32, max_batched_tokens=12, max_active_requests=3,
                             batch_invariant=True, **config)
        lengths = [18, 9, 23, 4, 15, 30]
        arrive = [0, 0, 1, 3, 3, 6]
        schedule, rids = [], []
        n = 0
        while len(rids) < len(lengths) or engine.has_unfinished():
            while len(rids) < len(lengths) and arrive[len(rids)] <= n:
                i = len(rids)
                rids.append(engine.add_request(prompt(120 + i, lengths[i]), GREEDY))
            step(engine)
            last = engine.last_step
            schedule.append((last["rows"], last["prefill_tokens"], last["decode_rows"], last["logits_rows"],
                             last["preempted"]))
            if engine.flights is not None:
                assert all(not f["followers"] for f in engine.snapshot()["prefix_cache"]["flights"])
            n += 1
            assert n < 200
        return engine, schedule, [engine.output(r).token_ids for r in rids]

    on, on_schedule, on_tokens = run(prefix_cache=True, single_flight="after_prefill")
    off, off_schedule, off_tokens = run(prefix_cache=False)
    assert on_schedule == off_schedule and on_tokens == off_tokens
    assert off.counters["preemptions"] == 0  # a preempted request would rightly restore its own pages
    assert max(len(rows) for rows, *_ in off_schedule) >= 3
    pc = on.snapshot()["prefix_cache"]
    assert pc["restored_tokens"] == 0 and pc["hits"] == 0 and pc["published_pages"] > 0
    assert pc["flight_counters"]["flights"] == 6 and pc["flight_counters"]["followers"] == 0
    for i, tokens in enumerate(off_tokens):
        want, margins = reference_tokens(tiny[0], tiny[1], prompt(120 + i, [18, 9, 23, 4, 15, 30][i]), GREEDY)
        check_greedy(tokens, want, margins, f"request {i}")
    free_equals_total(on)
    free_equals_total(off)


# -- 12: configuration errors name the field -----------------------------------------------------------


@pytest.mark.parametrize("config,field", [
    (dict(single_flight="after_prefill", prefix_cache=False), "single_flight"),
    (dict(single_flight="at_completion", kv_mode="contiguous"), "single_flight"),
    (dict(single_flight="sometimes"), "single_flight"),
    (dict(prefix_cache=True, kv_mode="contiguous"), "prefix_cache"),
    (dict(prefix_cache="yes"), "prefix_cache"),
    (dict(publication="eager"), "publication"),
])
def test_config_errors_name_the_field(config, field):
    with pytest.raises(ConfigError) as err:
        EngineConfig(**config)
    assert err.value.field == field


def test_prefix_cache_defaults():
    assert EngineConfig().prefix_cache_enabled is True
    assert EngineConfig(kv_mode="contiguous").prefix_cache_enabled is False
    assert EngineConfig(prefix_cache=False, single_flight="off").prefix_cache_enabled is False
    assert ROOT_KEY == 0


@pytest.mark.cuda
@pytest.mark.parametrize("config", [dict(prefix_cache=True), dict(prefix_cache=True, single_flight="after_prefill")],
                         ids=["cache", "cache+single-flight"])
def test_outputs_are_identical_with_the_cache_on_or_off_on_cuda(small_gpu_model_path, config):
    """The same reference on a GPU in f16: the invariant Triton kernels (GEMV, paged
    attention over the block table, row-wise RMSNorm) and decode CUDA graphs must read
    restored pages exactly as the request's own."""
    llm = LLM(str(small_gpu_model_path), device="cuda", dtype="float16", max_model_len=SMOL_LEN, progress=False,
              batch_invariant=True, prefix_cache=False)
    _, want, _ = shared_document_workload(llm, prefix_cache=False)
    engine, got, restored = shared_document_workload(llm, **config)
    assert got == want
    assert restored[0] == 0 and min(restored[1:]) > 0, restored
    assert engine.snapshot()["kernels"]["cuda_graphs"]["replays"] > 0
