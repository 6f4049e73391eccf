"""Speculative decoding inside the engine (minivllm/spec/, engine/draft_runner.py,
engine/model_runner.py's verification rows, scheduler._add_draft_tokens/_apply_round).

References, per test (never output the engine recorded from itself):

* the same workload on a target-only engine in batch-invariant mode, where every row's
  arithmetic is independent of the batch: greedy speculation must reproduce it token
  for token;
* the single-sequence path (`DecoderModel.forward` over a `ContiguousKVCache`, one
  request alone), with the near-tie tolerance of test_prefix_cache.py;
* an independent simulation of the speculative rounds from single-sequence greedy
  references of the target and the draft (proposal, longest accepted prefix, one extra
  token per round), which predicts rounds / proposed / accepted / bonus exactly;
* exact next-token distributions of the target (and the draft) from a plain forward,
  compared with empirical distributions by a chi-square test;
* the bookkeeping checker tests/engine_invariants.py after every step, plus the draft
  pool's own page accounting recomputed from the requests' draft block tables.

The draft/target pair: one tiny synthetic Llama loaded twice, the draft copy's attention
output and MLP down projections perturbed with Gaussian noise, so greedy acceptance is
partial. Everything is f32 on the CPU.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import single_sequence
import torch
from engine_invariants import check_invariants, free_equals_total

from minivllm import SamplingParams
from minivllm.cache.contiguous import ContiguousKVCache
from minivllm.cache.page_pool import PagePool
from minivllm.engine.engine import LLMEngine
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.request import Status
from minivllm.errors import ConfigError
from minivllm.kernels.kernel_options import KernelOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_LEN = 64  # max_model_len of tiny-model engines
NEAR_TIE = 1e-4  # top-2 logit margin below which a flipped greedy token is tolerated
POLICIES = ("fixed:2", "fixed:5", "acceptance-rate", "accepted-length+gate")


# -- the tiny pair --------------------------------------------------------------------------


def load_tiny(path):
    from minivllm.gguf.reader import GGUFFile
    from minivllm.gguf.tokenizer import Tokenizer
    from minivllm.model.loader import load_model

    gguf = GGUFFile(path)
    model = load_model(gguf, torch.device("cpu"), torch.float32, progress=False,
                       kernel_options=KernelOptions(gemv_max_rows=0))
    return model, Tokenizer.from_gguf(gguf)


def perturb(model, scale: float, seed: int) -> None:
    """Add N(0, (scale * std)^2) noise to every layer's attn_output and ffn_down F32 weights
    (new tensors: the loaded bytes may be a view of the file)."""
    g = torch.Generator().manual_seed(seed)
    for layer in model.layers:
        for name in ("o", "down"):
            lin = getattr(layer, name)
            w = lin.weight
            assert w.type_name == "F32"
            dense = w.raw.view(torch.float32).reshape(w.shape).clone()
            dense += scale * float(dense.std()) * torch.randn(dense.shape, generator=g)
            w.raw = dense.contiguous().view(torch.uint8).reshape(w.raw.shape)
            lin.drop_dequant_cache()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from synthetic_gguf import write_tiny_model

    # weight_std 0.3 (not the default 0.08): peaked next-token distributions, so the
    # distribution test has a dominant first token and few effective categories.
    return write_tiny_model(tmp_path_factory.mktemp("spec") / "tiny.gguf", n_layers=2, d_model=64, d_ff=128,
                            n_heads=4, n_kv_heads=2, vocab_size=512, context_length=256, seed=3, weight_std=0.3)


@pytest.fixture(scope="module")
def pair(tiny_path):
    """(target, draft, tokenizer): two DecoderModels from one file, the draft perturbed."""
    target, tokenizer = load_tiny(tiny_path)
    draft, draft_tokenizer = load_tiny(tiny_path)
    assert draft is not target and draft_tokenizer.vocab_size == tokenizer.vocab_size == 512
    perturb(draft, scale=0.12, seed=0)
    ids = prompt(1, 9)
    pt, pd = next_logits(target, ids), next_logits(draft, ids)
    assert not torch.equal(pt, pd), "the perturbation did not reach the draft"
    fresh, _ = load_tiny(tiny_path)
    assert torch.equal(next_logits(fresh, ids), pt), "perturbing the draft changed the target"
    return target, draft, tokenizer


def make_engine(target, tokenizer, draft=None, *, pages: int | None = None, draft_name: str = "draft",
                **config) -> LLMEngine:
    """An engine over the tiny target (with `draft`: speculating); `pages` sizes the KV pool."""
    config.setdefault("max_model_len", TINY_LEN)
    config.setdefault("gemv_max_rows", 0)
    config.setdefault("page_size", 4)
    if pages is not None:
        c = target.config
        config["kv_memory_bytes"] = pages * PagePool.page_bytes(n_layers=c.n_layers, page_size=config["page_size"],
                                                                n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                                                dtype=target.dtype)
    engine = LLMEngine(target, tokenizer, EngineConfig(**config), draft_model=draft,
                       draft_tokenizer=tokenizer if draft is not None else None, draft_name=draft_name)
    if pages is not None:
        assert engine.pool.num_pages == pages
    return engine


def prompt(seed: int, n: int) -> list[int]:
    """n pseudo-random token ids, never EOS (509, 511 in the tiny vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 509, (n,), generator=g).tolist()


# -- single-sequence references -----------------------------------------------------------------


@torch.inference_mode()
def next_logits(model, ids: list[int]) -> torch.Tensor:
    """The next-token logits after `ids`: one plain single-sequence f32 forward."""
    c = model.config
    cache = ContiguousKVCache(c.n_layers, len(ids), c.n_kv_heads, c.head_dim, model.dtype, "cpu")
    with model.using(KernelOptions(gemv_max_rows=0)):
        return model.forward(torch.tensor(ids), 0, cache).double()


def greedy_reference(model, ids: list[int], max_tokens: int, *, stops=(), max_model_len: int = TINY_LEN):
    """One request alone, greedy, on the plain f32 GEMM path: (tokens, top-2 logit margins).
    Ends at a stop id, max_tokens or max_model_len."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stops))
    return single_sequence.reference_tokens(model, None, ids, params, max_model_len=max_model_len,
                                            kernel_options=KernelOptions(gemv_max_rows=0))


def check_greedy(got: list[int], want: list[int], margins: list[float], label: str) -> None:
    single_sequence.check_greedy(got, want, margins, label, NEAR_TIE)


# Length controllers written from spec/draft_policy.py's documented rules (not its code).
class _Fixed:
    def __init__(self, k):
        self.k = k

    def update(self, accepted, proposed):
        pass


class _AcceptanceRate:  # below 0.4: k - 1, above 0.8: k + 1, within [1, 8], from k = 4
    def __init__(self):
        self.k = 4

    def update(self, accepted, proposed):
        rate = accepted / proposed
        self.k = max(self.k - 1, 1) if rate < 0.4 else min(self.k + 1, 8) if rate > 0.8 else self.k


class _AcceptedLength:  # s <- 0.2 a + 0.8 s from s = 3; k = clamp(round-half-up(s) + 1, 1, 8)
    def __init__(self):
        self.s, self.k = 3.0, 4

    def update(self, accepted, proposed):
        self.s = 0.2 * accepted + 0.8 * self.s
        self.k = min(max(int(self.s + 0.5) + 1, 1), 8)


CONTROLLERS = {"fixed:2": lambda: _Fixed(2), "fixed:5": lambda: _Fixed(5),
               "acceptance-rate": _AcceptanceRate, "accepted-length": _AcceptedLength}


def simulate_rounds(draft, ids: list[int], target_out: list[int], controller, max_tokens: int) -> dict:
    """Replay greedy speculation on single-sequence references: each round the draft
    greedily continues the committed tokens for k = min(controller's k, room) tokens, the
    target (its greedy output `target_out`) accepts the longest matching prefix, and the
    round adds one more token (the correction, or the bonus when all k matched).

    The draft's proposals come from the single-sequence path, the engine's from batched
    forwards: they agree except where the draft reference is at a near-tie. `sure` is
    False when a proposal token the outcome depends on was one (then no exact prediction)."""
    stats = {"proposed": 0, "accepted": 0, "bonus_tokens": 0, "rounds": 0, "plain_steps": 0, "sure": True}
    hist: Counter = Counter()
    j = 1  # the first token comes from the prefill
    while j < max_tokens:
        committed = ids + target_out[:j]
        k = min(controller.k, max_tokens - j - 1, TINY_LEN - len(committed) - 1)
        if k <= 0:
            stats["plain_steps"] += 1
            j += 1
            continue
        proposal, draft_margins = greedy_reference(draft, committed, k)
        a = 0
        while a < k and proposal[a] == target_out[j + a]:
            a += 1
        if min(draft_margins[:min(a + 1, k)]) < NEAR_TIE:  # the accepted tokens and the first rejected one
            stats["sure"] = False
        stats["rounds"] += 1
        stats["proposed"] += k
        stats["accepted"] += a
        stats["bonus_tokens"] += int(a == k)
        hist[str(k)] += 1
        controller.update(a, k)
        j += a + 1
    stats["draft_length_histogram"] = dict(hist)
    return stats


# -- driving engines --------------------------------------------------------------------------


def draft_pool_check(engine: LLMEngine) -> None:
    """The draft pool's pages are exactly the live requests' draft block tables, and no
    request has draft K/V past what the target accepted."""
    spec = engine.speculator
    pool = spec.drafter.pool
    everyone = [engine.request_state(r) for r in engine.request_ids()]
    live = [r for r in everyone if r.status != Status.FINISHED]
    held = Counter(p for r in live for p in r.draft_block_table)
    assert all(n == 1 for n in held.values()), f"a draft page is held twice: {held}"
    for p in range(pool.num_pages):
        assert pool.refcount[p] == held.get(p, 0), f"draft page {p}: refcount {pool.refcount[p]}, held {held.get(p, 0)}"
    assert pool.num_pages - pool.num_free == sum(len(r.draft_block_table) for r in live)
    assert engine.kv_ownership()["draft"] == {r.id: r.draft_block_table for r in live}
    running = engine.progress()
    for r in everyone:
        table, computed = r.draft_block_table, r.draft_computed
        if r.status == Status.FINISHED or r.id not in running:
            assert table == [] and computed == 0, f"{r.id} ({r.status.value}) keeps draft K/V"
            continue
        # The draft keeps K/V only for positions whose tokens the target accepted.
        assert computed <= r.num_computed <= r.num_tokens - 1, (r.id, computed, r.num_computed, r.num_tokens)
        assert len(table) == pool.pages_for(computed), (r.id, table, computed)


def step_checked(engine: LLMEngine) -> list:
    events = engine.step()
    check_invariants(engine)
    if engine.speculator is not None:
        draft_pool_check(engine)
    return events


def run_to_end(engine: LLMEngine, max_steps: int = 2000, on_step=None) -> int:
    for n in range(max_steps):
        if not engine.has_unfinished():
            return n
        step_checked(engine)
        if on_step is not None:
            on_step(engine)
    raise AssertionError(f"no progress within {max_steps} steps")


def all_free(engine: LLMEngine) -> None:
    """Both pools hold nothing: the target's pages are free or cached-idle (then freed by
    clearing the prefix cache), the draft's are all free."""
    pool = engine.speculator.drafter.pool
    assert pool.num_free == pool.num_pages, f"draft pool: {pool.num_free} free of {pool.num_pages}"
    assert all(r == 0 for r in pool.refcount)
    free_equals_total(engine)


GREEDY40 = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
STAGGER = {0: [0, 1], 3: [2], 6: [3]}  # step -> requests submitted before it
PROMPT_LENS = (6, 11, 17, 23)


def staggered_run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[str], list[dict]]:
    """Submit the prompts over the first steps (later ones prefill while earlier ones
    speculate), run to the end; returns request ids and every step's description."""
    rids: list[str | None] = [None] * len(prompts)
    steps = []
    n = 0
    while n < 1000 and (engine.has_unfinished() or any(r is None for r in rids)):
        for i in STAGGER.get(n, []):
            rids[i] = engine.add_request(prompts[i], params)
        step_checked(engine)
        steps.append(dict(engine.last_step))
        n += 1
    assert not engine.has_unfinished()
    return rids, steps


# -- 1: greedy speculation reproduces target-only greedy ------------------------------------------


_target_only: dict = {}


def target_only_outputs(target, tokenizer, prompts) -> list[list[int]]:
    key = tuple(map(tuple, prompts))
    if key not in _target_only:
        engine = make_engine(target, tokenizer, batch_invariant=True, max_batched_tokens=40)
        rids = [engine.add_request(p, GREEDY40) for p in prompts]
        run_to_end(engine)
        outs = [engine.pop_output(r) for r in rids]
        assert all(o.finish_reason == "length" for o in outs)
        _target_only[key] = [o.token_ids for o in outs]
    return _target_only[key]


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_speculation_matches_target_only(pair, policy):
    """Batch-invariant greedy speculation equals target-only greedy token for token, with exact round stats."""
    target, draft, tokenizer = pair
    prompts = [prompt(10 + i, n) for i, n in enumerate(PROMPT_LENS)]
    want = target_only_outputs(target, tokenizer, prompts)
    for p, w in zip(prompts, want):  # the target-only engine against the single-sequence path
        ref, margins = greedy_reference(target, p, 40)
        check_greedy(w, ref, margins, "target-only")

    engine = make_engine(target, tokenizer, draft, batch_invariant=True, max_batched_tokens=40, draft_policy=policy)
    if policy.endswith("+gate"):
        # The pay-off gate decides from each step's measured seconds. Give it one fixed unit
        # per step instead, so which rounds run (and the totals asserted below) follow the
        # tokens, not this machine's speed or load; the gate's own logic still decides.
        record = engine.speculator.record_time
        engine.speculator.record_time = lambda req, tokens, seconds, **kw: record(req, tokens, 1.0, **kw)
    rids, steps = staggered_run(engine, prompts, GREEDY40)
    mixed = [s for s in steps if any(r["draft_tokens"] > 0 for r in s["rows"])
             and any(r["phase"] == "prefill" for r in s["rows"])]
    assert mixed, "no step carried a verification row next to a prefill row"
    assert any(r["tokens"] == 1 + r["draft_tokens"] for s in mixed for r in s["rows"] if r["draft_tokens"])

    totals = Counter()
    predicted = 0
    for i, (rid, p) in enumerate(zip(rids, prompts)):
        out = engine.pop_output(rid)
        assert out.finish_reason == "length"
        assert out.token_ids == want[i], f"{policy} {rid}: {out.token_ids} vs target-only {want[i]}"
        s = out.metrics.speculation
        # Every round adds its accepted tokens plus one (correction or bonus); plain
        # decode steps one; the prefill the first token.
        assert len(out.token_ids) == 1 + s["plain_steps"] + s["accepted"] + s["rounds"], s
        hist = {int(k): v for k, v in s["draft_length_histogram"].items()}
        assert sum(hist.values()) == s["rounds"] and sum(k * v for k, v in hist.items()) == s["proposed"], s
        assert s["bonus_tokens"] <= s["rounds"] and s["accepted"] <= s["proposed"]
        assert s["tv_mean"] is None and s["tv_max"] is None
        if policy in CONTROLLERS:  # the gate's decisions depend on step times: no exact prediction
            expected = simulate_rounds(draft, p, want[i], CONTROLLERS[policy](), 40)
            sure = expected.pop("sure")
            got = {k: s[k] for k in expected}
            if sure:
                assert got == expected, f"{policy} {rid}: engine {got}, simulated {expected}"
            else:
                print(f"{policy} {rid}: a draft near-tie decides a round; simulated {expected}, engine {got}")
            predicted += sure
        totals.update({k: s[k] for k in ("proposed", "accepted", "bonus_tokens", "rounds")})
    if policy in CONTROLLERS:  # not vacuous: near-ties are rare, most requests were predicted exactly
        assert predicted >= len(prompts) - 1, f"{policy}: only {predicted} of {len(prompts)} predicted"
    assert totals["rounds"] > 0 and totals["accepted"] > 0 and totals["bonus_tokens"] > 0, totals
    assert totals["accepted"] < totals["proposed"], f"no rejection: {totals}"
    rate = totals["accepted"] / totals["proposed"]
    assert 0.10 < rate < 0.95, f"acceptance {rate:.2f}: the pair should accept partially"
    all_free(engine)


def test_engine_totals_equal_the_sum_of_request_stats(pair):
    """The snapshot's speculation totals equal the finished requests' own counters (incl. plain_steps)."""
    target, draft, tokenizer = pair
    engine = make_engine(target, tokenizer, draft, draft_policy="fixed:2")
    # max_tokens=2: the prefill gives token 1; no room for a proposal after it, so token 2
    # comes from a plain decode step, which is the request's last.
    rid = engine.add_request(prompt(3, 7), SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    run_to_end(engine)
    mine = engine.pop_output(rid).metrics.speculation
    assert mine["plain_steps"] == 1 and mine["rounds"] == 0, mine
    assert engine.snapshot()["speculative"]["plain_steps"] == 1, (
        f"engine totals {engine.snapshot()['speculative']} miss the plain step of the request's last token")

    engine = make_engine(target, tokenizer, draft, draft_policy="fixed:2")
    rids = [engine.add_request(prompt(20 + i, 5 + 2 * i), SamplingParams(temperature=0.0, max_tokens=10 + i,
                                                                       ignore_eos=True)) for i in range(4)]
    run_to_end(engine)
    sums = Counter()
    for rid in rids:
        s = engine.pop_output(rid).metrics.speculation
        sums.update({k: s[k] for k in ("proposed", "accepted", "bonus_tokens", "rounds", "plain_steps")})
    snap = engine.snapshot()["speculative"]
    assert {k: snap[k] for k in sums} == dict(sums)


# -- 2: a draft identical to the target ---------------------------------------------------------


def test_identical_draft_accepts_everything_tiny(pair):
    """The target itself as draft: 100% greedy acceptance and a bonus token every round."""
    target, _, tokenizer = pair
    prompts = [prompt(10 + i, n) for i, n in enumerate(PROMPT_LENS)]
    want = target_only_outputs(target, tokenizer, prompts)
    engine = make_engine(target, tokenizer, target, batch_invariant=True, max_batched_tokens=40,
                         draft_policy="fixed:4")
    rids, _ = staggered_run(engine, prompts, GREEDY40)
    for rid, w in zip(rids, want):
        out = engine.pop_output(rid)
        s = out.metrics.speculation
        assert out.token_ids == w
        assert s["acceptance_rate"] == 1.0 and s["accepted"] == s["proposed"] > 0, s
        assert s["bonus_tokens"] == s["rounds"] > 0, s
        assert len(out.token_ids) == 1 + s["plain_steps"] + s["accepted"] + s["rounds"]
    all_free(engine)


@pytest.fixture(scope="module")
def qwen05(qwen05_path):
    from minivllm.engine.llm import LLM

    return LLM(str(qwen05_path), progress=False, max_model_len=128, kv_memory_bytes=8 << 20)


def test_identical_draft_accepts_everything_qwen(qwen05):
    """Qwen2.5-Coder-0.5B drafting for itself: 100% acceptance, bonus every round, output == target-only."""
    llm = qwen05
    ids = llm.tokenizer.encode("def fibonacci(n):\n    ")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    config = dict(max_model_len=128, kv_memory_bytes=8 << 20, batch_invariant=True)
    plain = LLMEngine(llm.model, llm.tokenizer, EngineConfig(**config))
    rid = plain.add_request(ids, params)
    while plain.has_unfinished():
        plain.step()
    want = plain.pop_output(rid).token_ids
    assert len(want) == 24

    engine = LLMEngine(llm.model, llm.tokenizer, EngineConfig(**config, draft_policy="fixed:4"),
                       draft_model=llm.model, draft_tokenizer=llm.tokenizer, draft_name="qwen-self")
    rid = engine.add_request(ids, params)
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)
    out = engine.pop_output(rid)
    s = out.metrics.speculation
    assert out.token_ids == want
    assert s["accepted"] == s["proposed"] and s["acceptance_rate"] == 1.0, s
    # 23 tokens after the prefill's: rounds of 4 + bonus, the last one capped by max_tokens.
    assert s["bonus_tokens"] == s["rounds"] == 5 and s["proposed"] == 18, s
    assert s["draft_length_histogram"] == {"2": 1, "4": 4}, s
    assert engine.snapshot()["speculative"]["draft_model"] == "qwen-self"
    all_free(engine)


# -- 3: sampling and the TV budget ----------------------------------------------------------------


def test_tv_budget_one_accepts_every_draft_token(pair):
    """tv_budget=1 accepts every sampled draft token; greedy requests in the same engine still verify by equality."""
    target, draft, tokenizer = pair
    engine = make_engine(target, tokenizer, draft, draft_policy="fixed:3", tv_budget=1.0)
    sampled = [engine.add_request(prompt(30 + i, 8), SamplingParams(temperature=0.8, max_tokens=20, seed=i,
                                                                  ignore_eos=True)) for i in range(4)]
    greedy_ids = [prompt(40 + i, 8) for i in range(2)]
    greedy = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
              for p in greedy_ids]
    run_to_end(engine)
    for rid in sampled:
        out = engine.pop_output(rid)
        s = out.metrics.speculation
        assert len(out.token_ids) == 20
        assert s["proposed"] > 0 and s["acceptance_rate"] == 1.0 and s["bonus_tokens"] == s["rounds"], s
        assert isinstance(s["tv_mean"], float) and 0.0 < s["tv_mean"] <= s["tv_max"] <= 1.0, s
    g = Counter()
    for rid, p in zip(greedy, greedy_ids):
        out = engine.pop_output(rid)
        ref, margins = greedy_reference(target, p, 20)
        check_greedy(out.token_ids, ref, margins, rid)
        s = out.metrics.speculation
        assert s["tv_mean"] is None
        g.update({"accepted": s["accepted"], "proposed": s["proposed"]})
    assert g["accepted"] < g["proposed"], f"greedy verification took the TV budget: {g}"
    all_free(engine)


def test_lossless_identical_draft_accepts_everything_when_sampling(pair):
    """tv_budget=0 and the target as its own draft: every sampled proposal is accepted, TV 0."""
    target, _, tokenizer = pair
    engine = make_engine(target, tokenizer, target, batch_invariant=True, draft_policy="fixed:3", tv_budget=0.0)
    rids = [engine.add_request(prompt(50 + i, 7), SamplingParams(temperature=0.8, top_k=50, max_tokens=18, seed=i,
                                                               ignore_eos=True)) for i in range(3)]
    run_to_end(engine)
    for rid in rids:
        s = engine.pop_output(rid).metrics.speculation
        assert s["proposed"] > 0 and s["acceptance_rate"] == 1.0 and s["bonus_tokens"] == s["rounds"], s
        assert s["tv_mean"] == 0.0 and s["tv_max"] == 0.0, s
    assert engine.snapshot()["speculative"]["tv_mean"] == 0.0
    all_free(engine)


# -- 4: the output distribution -------------------------------------------------------------------


def chi_square_p(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson's test of `counts` (n draws) against `probs`, categories with an expected
    count below 5 merged into one bin. Returns (p-value, bins)."""
    expected = probs.double() * n
    big = (expected >= 5).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big]
    exp = [float(expected[t]) for t in big]
    rest_o, rest_e = n - sum(observed), n - sum(exp)
    if rest_e > 0:
        observed.append(rest_o)
        exp.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, exp))
    df = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), len(exp)


DIST_PROMPT = (2, 8)  # prompt(2, 8): the tiny target's first token has one dominant value


@pytest.mark.parametrize("tv_budget", [0.0, 0.1])
def test_sampled_speculation_distribution(pair, tv_budget):
    """The verified token's distribution is the target's (tv_budget=0) or the documented mixture π (0.1)."""
    target, draft, tokenizer = pair
    ids = prompt(*DIST_PROMPT)
    n = 1600
    engine = make_engine(target, tokenizer, draft, draft_policy="fixed:2", tv_budget=tv_budget,
                         max_active_requests=200, max_batched_tokens=4096, prefix_cache=False)
    # max_tokens=3: token 1 from the prefill, then one round of k = 1 (room for 2 tokens):
    # token 2 is the verified one (draft token accepted or replaced), token 3 the bonus or
    # the next round's.
    rids = [engine.add_request(ids, SamplingParams(temperature=1.0, max_tokens=3, seed=1000 + i, ignore_eos=True))
            for i in range(n)]
    while engine.has_unfinished():
        engine.step()
    outs = [engine.pop_output(r) for r in rids]
    snap = engine.snapshot()["speculative"]
    assert snap["rounds"] == n and snap["proposed"] == n, snap  # one round of k = 1 per request
    assert 0 < snap["accepted"] < snap["proposed"], f"the replacement path must run too: {snap}"
    assert all(len(o.token_ids) == 3 for o in outs)

    p1 = torch.softmax(next_logits(target, ids), -1)
    first = Counter(o.token_ids[0] for o in outs)
    pv, _ = chi_square_p(first, p1, n)
    assert pv > 1e-4, f"first tokens (plain sampling) do not follow the target: p={pv:.2e}"

    x, count = first.most_common(1)[0]
    assert count >= 0.4 * n, first.most_common(3)
    second = Counter(o.token_ids[1] for o in outs if o.token_ids[0] == x)
    p = torch.softmax(next_logits(target, ids + [x]), -1)
    q = torch.softmax(next_logits(draft, ids + [x]), -1)
    d = 0.5 * float((p - q).abs().sum())
    assert d > 0.1, f"the pair is too close here (TV {d:.3f}) to test anything"
    theta = 0.0 if tv_budget == 0 else min(1.0, tv_budget / d)
    want = (1 - theta) * p + theta * q  # spec/verify.py's π
    pv, bins = chi_square_p(second, want, count)
    assert bins >= 5
    assert pv > 1e-4, f"second token after {x} ({count} samples, {bins} bins): p={pv:.2e} against π (D={tv_budget})"
    if tv_budget == 0.0:  # and clearly not the draft's own distribution
        pq, _ = chi_square_p(second, q, count)
        assert pq < 1e-6, f"the verified tokens look like the draft's samples (p={pq:.2e})"


# -- 5: cancellation, preemption, completion free both caches -----------------------------------------


def test_abort_during_speculation_frees_both_pools(pair):
    """Aborting requests mid-generation frees every page of the target and the draft pool."""
    target, draft, tokenizer = pair
    engine = make_engine(target, tokenizer, draft, draft_policy="fixed:3")
    dpool = engine.speculator.drafter.pool
    rids = [engine.add_request(prompt(60 + i, 9 + 4 * i), SamplingParams(temperature=0.0 if i % 2 else 0.7,
                                                                       seed=i, max_tokens=40))
            for i in range(4)]
    for _ in range(50):
        step_checked(engine)
        if engine.snapshot()["speculative"]["rounds"] > 0 and dpool.num_free < dpool.num_pages:
            break
    assert dpool.num_free < dpool.num_pages and engine.snapshot()["speculative"]["rounds"] > 0
    assert all(engine.request_state(r).status == Status.RUNNING for r in rids)
    for rid in rids:
        event = engine.abort(rid)
        assert event is not None and event.finish_reason == "abort"
        check_invariants(engine)
        draft_pool_check(engine)
    assert not engine.has_unfinished()
    for rid in rids:
        assert engine.pop_output(rid).finish_reason == "abort"
    all_free(engine)


def test_preemption_with_speculation_frees_draft_pages(pair):
    """Under a tiny KV budget requests get preempted mid-speculation; draft pages follow, all free at the end."""
    target, draft, tokenizer = pair
    engine = make_engine(target, tokenizer, draft, draft_policy="fixed:3", pages=20)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True) for _ in range(4)]
    prompts = [prompt(70 + i, 10 + i) for i in range(4)]
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    preempted_spec = []

    def watch(e):
        for r in e.last_step["preempted"]:
            req = e.request_state(r)
            preempted_spec.append(req.speculation["rounds"])
            assert req.draft_block_table == [] and req.draft_computed == 0

    run_to_end(engine, on_step=watch)
    assert engine.counters["preemptions"] > 0, "the KV budget should have forced preemption"
    assert any(n > 0 for n in preempted_spec), "no request was preempted after it had speculated"
    for rid, p in zip(rids, prompts):
        out = engine.pop_output(rid)
        assert out.finish_reason == "length"
        ref, margins = greedy_reference(target, p, 40)
        check_greedy(out.token_ids, ref, margins, rid)
    all_free(engine)


# -- 6: incompatible drafts -----------------------------------------------------------------------


def test_mismatched_vocabulary_refused_real_models(qwen05, smollm2_path):
    """SmolLM2-135M cannot draft for Qwen2.5-Coder-0.5B: ConfigError naming draft_model and both sizes."""
    from minivllm.engine.llm import LLM

    small = LLM(str(smollm2_path), progress=False, max_model_len=64, kv_memory_bytes=1 << 20)
    with pytest.raises(ConfigError) as info:
        LLMEngine(qwen05.model, qwen05.tokenizer, EngineConfig(max_model_len=64, kv_memory_bytes=1 << 20),
                  draft_model=small.model, draft_tokenizer=small.tokenizer, draft_name="smollm2")
    err = info.value
    assert err.field == "draft_model" and err.value == "smollm2"
    msg = str(err)
    assert str(small.tokenizer.vocab_size) in msg and str(qwen05.tokenizer.vocab_size) in msg, msg


class _RenamedTokenizer:
    """A tokenizer whose id `renamed` spells another text, or whose EOS ids differ."""

    def __init__(self, inner, renamed: int | None = None, eos_ids=None):
        self.inner, self.renamed = inner, renamed
        self.eos_ids = frozenset(eos_ids) if eos_ids is not None else inner.eos_ids
        self.vocab_size = inner.vocab_size

    def id_to_token(self, i):
        return "<<renamed>>" if i == self.renamed else self.inner.id_to_token(i)


def test_mismatched_vocabulary_refused_tiny(pair, tmp_path):
    """A tiny draft with another vocab size, a renamed token id, or other EOS ids is refused naming the difference."""
    from synthetic_gguf import write_tiny_model

    target, _, tokenizer = pair
    path = write_tiny_model(tmp_path / "other.gguf", n_layers=1, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2,
                            vocab_size=640, context_length=256, seed=5)
    other, other_tok = load_tiny(path)
    with pytest.raises(ConfigError) as info:
        LLMEngine(target, tokenizer, EngineConfig(max_model_len=TINY_LEN), draft_model=other,
                  draft_tokenizer=other_tok, draft_name="tiny-640")
    assert info.value.field == "draft_model" and info.value.value == "tiny-640"
    assert "640" in str(info.value) and "512" in str(info.value), str(info.value)

    with pytest.raises(ConfigError) as info:
        LLMEngine(target, tokenizer, EngineConfig(max_model_len=TINY_LEN), draft_model=target,
                  draft_tokenizer=_RenamedTokenizer(tokenizer, renamed=300))
    assert info.value.field == "draft_model"
    assert "token id 300" in str(info.value) and "<<renamed>>" in str(info.value), str(info.value)

    with pytest.raises(ConfigError) as info:
        LLMEngine(target, tokenizer, EngineConfig(max_model_len=TINY_LEN), draft_model=target,
                  draft_tokenizer=_RenamedTokenizer(tokenizer, eos_ids=[509]))
    assert info.value.field == "draft_model" and "[509]" in str(info.value), str(info.value)

    # The same vocabulary from a differently seeded file is accepted (and drafts badly).
    path = write_tiny_model(tmp_path / "seed9.gguf", n_layers=2, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2,
                            vocab_size=512, context_length=256, seed=9, weight_std=0.3)
    low, low_tok = load_tiny(path)
    engine = LLMEngine(target, tokenizer, EngineConfig(max_model_len=TINY_LEN, gemv_max_rows=0, page_size=4),
                       draft_model=low, draft_tokenizer=low_tok)
    ids = prompt(80, 9)
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    run_to_end(engine)
    out = engine.pop_output(rid)
    ref, margins = greedy_reference(target, ids, 20)
    check_greedy(out.token_ids, ref, margins, "low-acceptance draft")
    s = out.metrics.speculation
    assert s["rounds"] > 0 and s["accepted"] < s["proposed"], s
    all_free(engine)


# -- 7: a random program keeps every invariant ----------------------------------------------------


@pytest.mark.parametrize("variant", [
    dict(draft_policy="fixed:3"),
    dict(draft_policy="acceptance-rate+gate", single_flight="after_prefill", publication="incremental"),
    dict(draft_policy="accepted-length", publication="at_completion", policy="round-robin"),
], ids=["fixed3", "adaptive-gate-singleflight", "accepted-length-at-completion"])
def test_random_program_keeps_invariants(pair, variant):
    """A seeded random add/abort/step program with speculation keeps both pools' bookkeeping exact."""
    target, draft, tokenizer = pair
    rng = random.Random(1234)
    engine = make_engine(target, tokenizer, draft, pages=30, max_active_requests=8,
                         max_batched_tokens=48, prefix_cache=True, **variant)
    if "gate" in variant.get("draft_policy", ""):
        # The pay-off gate decides from measured step times: one fixed unit per step instead,
        # so the program (and its pool pressure) is the same on every machine.
        record = engine.speculator.record_time
        engine.speculator.record_time = lambda req, tokens, seconds, **kw: record(req, tokens, 1.0, **kw)
    bases = [prompt(90 + i, 8) for i in range(3)]
    submitted: dict[str, tuple[list[int], SamplingParams]] = {}
    steps = 0
    while steps < 150:
        r = rng.random()
        live = [rid for rid in engine.request_ids() if engine.request_state(rid).status != Status.FINISHED]
        if r < 0.25 and len(live) < 12:
            ids = list(rng.choice(bases)) if rng.random() < 0.7 else []
            ids += [rng.randrange(0, 509) for _ in range(rng.randint(1, 12))]
            if rng.random() < 0.15 and submitted:  # an exact repeat: single-flight / full prefix hit
                ids = list(rng.choice(list(submitted.values()))[0])
            greedy = rng.random() < 0.5
            params = SamplingParams(temperature=0.0 if greedy else rng.choice([0.7, 1.0]),
                                    top_k=rng.choice([0, 20]), seed=rng.randrange(1000),
                                    max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.7,
                                    stop_token_ids=[rng.randrange(0, 509)] if rng.random() < 0.2 else [])
            rid = engine.add_request(ids, params)
            submitted[rid] = (ids, params)
            check_invariants(engine)
            draft_pool_check(engine)
        elif r < 0.32 and live:
            engine.abort(rng.choice(live))
            check_invariants(engine)
            draft_pool_check(engine)
        else:
            step_checked(engine)
            steps += 1
    run_to_end(engine)
    snap = engine.snapshot()
    assert snap["speculative"]["rounds"] > 0 and snap["speculative"]["accepted"] > 0
    assert engine.counters["preemptions"] > 0, "the program should exercise preemption"
    assert engine.counters["finished_abort"] > 0
    for rid, (ids, params) in submitted.items():
        out = engine.pop_output(rid)
        assert out.finish_reason in ("stop", "length", "abort"), (rid, out.finish_reason)
        assert len(out.token_ids) <= params.max_tokens
        if params.greedy and out.finish_reason != "abort":
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.eos_ids))
            ref, margins = greedy_reference(target, ids, params.max_tokens, stops=tuple(sorted(stops)))
            check_greedy(out.token_ids, ref, margins, rid)
    all_free(engine)


# -- 8: inspection ----------------------------------------------------------------------------------


SPEC_KEYS = {"enabled", "draft_model", "policy", "tv_budget", "shared_vocab", "proposed", "accepted",
             "acceptance_rate", "bonus_tokens", "rounds", "plain_steps", "draft_length_histogram", "tv_mean",
             "tv_max", "draft_forwards", "draft_tokens_computed", "draft_seconds", "draft_kv", "recent_rounds",
             "last_error"}
ROW_KEYS = {"proposed", "accepted", "acceptance_rate", "bonus_tokens", "rounds", "plain_steps",
            "draft_length_histogram", "tv_mean", "tv_max", "next_draft_tokens", "draft_computed_tokens",
            "draft_pages", "gate"}
STAT_KEYS = {"proposed", "accepted", "acceptance_rate", "bonus_tokens", "rounds", "plain_steps",
             "draft_length_histogram", "tv_mean", "tv_max"}


def test_snapshot_and_request_metrics(pair):
    """Snapshots carry the documented speculative section and per-request rows; outputs carry the stats."""
    target, draft, tokenizer = pair
    plain = make_engine(target, tokenizer)
    assert plain.snapshot()["speculative"] == {"enabled": False}
    rid = plain.add_request(prompt(1, 5), SamplingParams(temperature=0.0, max_tokens=3))
    run_to_end(plain)
    assert plain.pop_output(rid).metrics.speculation is None

    engine = make_engine(target, tokenizer, draft, draft_policy="accepted-length+gate", tv_budget=0.25,
                         draft_name="tiny-draft")
    snap = engine.snapshot()["speculative"]
    assert set(snap) == SPEC_KEYS and snap["enabled"] is True and snap["rounds"] == 0
    assert snap["policy"] == "accepted-length+gate" and snap["tv_budget"] == 0.25 and snap["shared_vocab"] == 512
    rids = [engine.add_request(prompt(100 + i, 6), SamplingParams(temperature=0.0 if i == 0 else 0.9, seed=i,
                                                                max_tokens=30, ignore_eos=True)) for i in range(3)]
    seen_rows = 0
    while engine.has_unfinished():
        step_checked(engine)
        full = engine.snapshot()
        assert json.loads(json.dumps(full)) == full
        snap = full["speculative"]
        assert set(snap) == SPEC_KEYS and snap["draft_model"] == "tiny-draft"
        dp = engine.speculator.drafter.pool
        assert snap["draft_kv"] == {"total_pages": dp.num_pages, "free_pages": dp.num_free, "page_size": 4}
        for rr in snap["recent_rounds"]:
            assert set(rr) == {"step", "request", "proposed", "accepted", "bonus", "tv_mean"}
            assert 0 <= rr["accepted"] <= rr["proposed"] and rr["bonus"] == (rr["accepted"] == rr["proposed"])
        for row in full["queues"]["running"]:
            sp = row["speculation"]
            assert set(sp) == ROW_KEYS, set(sp) ^ ROW_KEYS
            req = engine.request_state(row["id"])
            assert sp["draft_pages"] == len(req.draft_block_table)
            assert sp["draft_computed_tokens"] == req.draft_computed
            assert set(sp["gate"]) == {"state", "plain_tokens_per_s", "speculative_tokens_per_s", "pauses",
                                       "next_pause_tokens"}
            assert sp["gate"]["state"] in ("baseline", "speculating", "paused")
            seen_rows += 1
    assert seen_rows > 0
    snap = engine.snapshot()["speculative"]
    assert snap["rounds"] > 0 and snap["draft_forwards"] > 0 and snap["draft_tokens_computed"] > 0
    assert snap["draft_seconds"] > 0 and snap["last_error"] is None
    assert sum(int(k) * v for k, v in snap["draft_length_histogram"].items()) == snap["proposed"]
    for rid in rids:
        m = engine.pop_output(rid).metrics
        assert isinstance(m.speculation, dict) and set(m.speculation) == STAT_KEYS
        assert m.speculation["rounds"] > 0 and isinstance(m.speculation["draft_length_histogram"], dict)
        assert m.as_dict()["speculation"] == m.speculation


# -- 9: limits and stops ----------------------------------------------------------------------------


@pytest.mark.parametrize("same", [False, True], ids=["perturbed", "identical"])
def test_max_tokens_and_max_model_len_exact(pair, same):
    """Rounds never overshoot max_tokens (7 with fixed:5) or max_model_len."""
    target, draft, tokenizer = pair
    engine = make_engine(target, tokenizer, target if same else draft, batch_invariant=True, draft_policy="fixed:5")
    short_ids = prompt(110, 6)
    long_ids = prompt(111, TINY_LEN - 9)
    a = engine.add_request(short_ids, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True))
    b = engine.add_request(long_ids, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    c = engine.add_request(prompt(112, 6), SamplingParams(temperature=0.9, seed=3, max_tokens=7, ignore_eos=True))
    run_to_end(engine)
    oa, ob, oc = (engine.pop_output(r) for r in (a, b, c))
    assert len(oa.token_ids) == 7 and oa.finish_reason == "length"
    assert len(oc.token_ids) == 7 and oc.finish_reason == "length"
    assert len(ob.token_ids) == 9 and ob.finish_reason == "length"
    assert len(long_ids) + len(ob.token_ids) == TINY_LEN
    for out, ids, n in ((oa, short_ids, 7), (ob, long_ids, 100)):
        ref, margins = greedy_reference(target, ids, n)
        check_greedy(out.token_ids, ref, margins, out.request_id)
    for out in (oa, ob, oc):
        s = out.metrics.speculation
        assert s["rounds"] > 0
        assert len(out.token_ids) == 1 + s["plain_steps"] + s["accepted"] + s["rounds"], s
    if same:  # 6 tokens after the prefill's: one round of 5 + bonus
        assert oa.metrics.speculation["draft_length_histogram"] == {"5": 1}
        # 8 after the prefill's: 5 + bonus, then the 2 left: 1 + bonus
        assert ob.metrics.speculation["draft_length_histogram"] == {"5": 1, "1": 1}
    all_free(engine)


def test_stop_token_accepted_mid_proposal_ends_request(pair):
    """A stop token id accepted inside a proposal ends the request at that token, without a bonus."""
    target, _, tokenizer = pair
    for seed in range(120, 140):
        ids = prompt(seed, 7)
        ref, margins = greedy_reference(target, ids, 12)
        # a token first seen at index 2..4: in round 1 (indices 1..5 proposed), not its end
        j = next((j for j in range(2, 5) if ref[j] not in ref[:j]), None)
        if j is not None and min(margins[:j + 1]) > NEAR_TIE:
            break
    else:
        pytest.fail("no prompt with a fresh token at index 2..4")
    stop = ref[j]
    engine = make_engine(target, tokenizer, target, batch_invariant=True, draft_policy="fixed:5")
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                 stop_token_ids=[stop]))
    events = []
    while engine.has_unfinished():
        events += step_checked(engine)
    out = engine.pop_output(rid)
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:j + 1], f"stop {stop} at index {j}: got {out.token_ids}, reference {ref}"
    assert [e.token_id for e in events] == ref[:j + 1]
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    s = out.metrics.speculation
    # The draft stops proposing at the stop token: one round of j proposals, all accepted, no bonus.
    assert s["rounds"] == 1 and s["proposed"] == s["accepted"] == j and s["bonus_tokens"] == 0, s
    all_free(engine)


# -- robustness: a full draft pool, a failing draft, invalid settings ------------------------------


def test_full_draft_pool_decodes_without_proposals(pair):
    """When the draft pool cannot hold a proposal the request decodes plainly; outputs stay the target's."""
    target, draft, tokenizer = pair
    refused = Counter()
    # Six requests share a 40-token prompt in the target's prefix cache; the draft has no
    # sharing, so its pool (the target's size + 1 page) runs out.
    shared = prompt(300, 40)
    prompts = [shared + [i] for i in range(6)]
    engine = make_engine(target, tokenizer, draft, pages=40, draft_policy="fixed:4", max_active_requests=6)
    draft_kv = engine.speculator.drafter.kv
    original = draft_kv.allocate_slots

    def spy(owner, n_tokens, lookahead=0):
        got = original(owner, n_tokens, lookahead)
        refused[got is not None] += 1
        return got

    draft_kv.allocate_slots = spy
    rids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) for p in prompts]
    run_to_end(engine)
    assert refused[False] > 0 and refused[True] > 0, refused
    for rid, p in zip(rids, prompts):
        out = engine.pop_output(rid)
        ref, margins = greedy_reference(target, p, 20)
        check_greedy(out.token_ids, ref, margins, rid)
        s = out.metrics.speculation
        assert len(out.token_ids) == 1 + s["plain_steps"] + s["accepted"] + s["rounds"], s
    all_free(engine)


def test_failed_draft_forward_costs_only_speed(pair, monkeypatch):
    """A draft forward that raises is recorded in last_error; the requests finish with the target's tokens."""
    from minivllm.engine.draft_runner import DraftRunner

    target, draft, tokenizer = pair
    calls = Counter()
    original = DraftRunner._forward

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] in (3, 4):
            raise RuntimeError("draft exploded")
        return original(self, *args)

    monkeypatch.setattr(DraftRunner, "_forward", flaky)
    engine = make_engine(target, tokenizer, draft, draft_policy="fixed:3")
    prompts = [prompt(310 + i, 6 + 3 * i) for i in range(3)]
    rids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)) for p in prompts]
    run_to_end(engine)
    assert "draft exploded" in engine.snapshot()["speculative"]["last_error"]
    for rid, p in zip(rids, prompts):
        out = engine.pop_output(rid)
        assert out.finish_reason == "length"
        ref, margins = greedy_reference(target, p, 30)
        check_greedy(out.token_ids, ref, margins, rid)
        s = out.metrics.speculation
        assert s["rounds"] > 0 and len(out.token_ids) == 1 + s["plain_steps"] + s["accepted"] + s["rounds"], s
    all_free(engine)


@pytest.mark.parametrize(
    "field, value",
    [
        ("draft_policy", "fixed:0"),
        ("draft_policy", "fixed:33"),
        ("draft_policy", "sometimes"),
        ("draft_policy", "acceptance-rate:4,0.9,0.5"),
        ("draft_policy", "accepted-length:4,0"),
        ("tv_budget", 1.5),
        ("tv_budget", -0.1),
        ("tv_budget", True),
        ("num_draft_tokens", 0),
        ("num_draft_tokens", 33),
        ("num_draft_tokens", True),
    ],
)
def test_invalid_speculation_settings_name_the_field(field, value):
    """Invalid speculation settings raise ConfigError naming the field."""
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    assert info.value.field == field


def test_draft_context_length_limits_max_model_len(pair, tmp_path):
    """Both models see every position: the draft's shorter context caps max_model_len."""
    from synthetic_gguf import write_tiny_model

    target, _, tokenizer = pair
    path = write_tiny_model(tmp_path / "short.gguf", n_layers=1, d_model=64, d_ff=128, n_heads=4, n_kv_heads=2,
                            vocab_size=512, context_length=32, seed=3, weight_std=0.3)
    short, short_tok = load_tiny(path)
    with pytest.raises(ConfigError) as info:
        LLMEngine(target, tokenizer, EngineConfig(max_model_len=64), draft_model=short, draft_tokenizer=short_tok)
    assert info.value.field == "max_model_len" and "32" in str(info.value)
    engine = LLMEngine(target, tokenizer, EngineConfig(gemv_max_rows=0, page_size=4), draft_model=short,
                       draft_tokenizer=short_tok)
    assert engine.max_model_len == 32
    ids = prompt(320, 20)
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    run_to_end(engine)
    out = engine.pop_output(rid)
    assert out.finish_reason == "length" and len(ids) + len(out.token_ids) == 32
    ref, margins = greedy_reference(target, ids, 50, max_model_len=32)
    check_greedy(out.token_ids, ref, margins, rid)
    all_free(engine)
