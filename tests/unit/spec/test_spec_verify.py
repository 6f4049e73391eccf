"""Speculative decoding building blocks: verification math, draft-length policies, the
pay-off gate, counters and the EngineConfig fields that configure them.

Every expected value is computed here independently (numpy / fractions / hand-derived
from the documented rules), never recorded from the code under test. The distribution
tests are statistical but deterministic: fixed seeds, chi-square goodness of fit at a
small significance level, and a power check showing the same test does reject a wrong
target.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from minivllm.engine.engine_config import EngineConfig
from minivllm.errors import ConfigError
from minivllm.spec.draft_policy import (
    MAX_DRAFT_TOKENS,
    AcceptanceRateLength,
    AcceptedLengthAverage,
    DraftController,
    FixedLength,
    parse_draft_policy,
)
from minivllm.spec.payoff_gate import PayoffGate
from minivllm.spec.stats import SpecStats
from minivllm.spec.verify import Verdict, mentored_mixture, tv_distance, verify_greedy, verify_sampled

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- independent reference math ------------------------------------------------------


def _np_tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64)).sum())


def _np_mixture(p: np.ndarray, q: np.ndarray, budget: float) -> np.ndarray:
    """π = (1 − θ) p + θ q, θ = min(1, D / d) (θ = 1 when d = 0, θ = 0 when D = 0)."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    d = _np_tv(p, q)
    if budget <= 0.0:
        return p.copy()
    theta = 1.0 if d == 0.0 else min(1.0, budget / d)
    return (1.0 - theta) * p + theta * q


def _chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit of `observed` counts to `probs`.

    scipy is not installed in the venv, so the survival function of chi2(df) is computed
    as the regularised upper incomplete gamma Q(df/2, stat/2) (torch.special.gammaincc,
    float64). Categories with probability 0 must have no observations: any observation
    there is an impossible outcome and gives p-value 0.
    """
    observed = np.asarray(observed, np.float64)
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    n = observed.sum()
    zero = probs <= 0.0
    if observed[zero].sum() > 0:
        return 0.0
    expected = n * probs[~zero]
    obs = observed[~zero]
    stat = float(((obs - expected) ** 2 / expected).sum())
    df = int((~zero).sum()) - 1
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_chi2_pvalue_helper_matches_known_quantiles():
    """The hand-rolled chi-square survival function reproduces textbook quantiles."""
    sf = lambda df, x: float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),  # noqa: E731
                                                     torch.tensor(x / 2.0, dtype=torch.float64)))
    # chi2 table: df=5 at alpha=0.05 is 11.0705; df=9 at alpha=0.01 is 21.666; df=1, 0.05: 3.8415
    assert sf(5, 11.0705) == pytest.approx(0.05, abs=1e-4)
    assert sf(9, 21.666) == pytest.approx(0.01, abs=1e-4)
    assert sf(1, 3.8415) == pytest.approx(0.05, abs=1e-4)
    # df=2 has the closed form exp(-x/2)
    assert sf(2, 7.3) == pytest.approx(math.exp(-3.65), rel=1e-12)
    # a perfect fit has p-value 1; an impossible observation has p-value 0
    assert _chi2_pvalue(np.array([25, 25, 50]), np.array([0.25, 0.25, 0.5])) == pytest.approx(1.0)
    assert _chi2_pvalue(np.array([1, 49, 50]), np.array([0.0, 0.5, 0.5])) == 0.0


# --- distribution pairs --------------------------------------------------------------

# p on tokens 0..4, q on 2..7: tokens 0,1 have p > 0 = q, tokens 5,6,7 have q > 0 = p.
_P_DISJOINT = np.array([0.30, 0.25, 0.20, 0.15, 0.10, 0.00, 0.00, 0.00])
_Q_DISJOINT = np.array([0.00, 0.00, 0.10, 0.20, 0.30, 0.15, 0.15, 0.10])
_P_SAME = np.array([0.05, 0.10, 0.15, 0.20, 0.25, 0.15, 0.10])


def _dirichlet_pair() -> tuple[np.ndarray, np.ndarray]:
    """Random Dirichlet(0.5) pair over 10 tokens, mixed with 10% uniform so every
    probability is >= 0.01 (enough expected counts per category). With this seed
    d = TV(p, q) ~ 0.62 > 0.5, so D = 0.1, 0.3 and 0.5 are all strictly intermediate."""
    rng = np.random.default_rng(20240543)
    p = 0.9 * rng.dirichlet(np.full(10, 0.5)) + 0.01
    q = 0.9 * rng.dirichlet(np.full(10, 0.5)) + 0.01
    return p / p.sum(), q / q.sum()


PAIRS = {
    "disjoint": (_P_DISJOINT, _Q_DISJOINT),
    "same": (_P_SAME, _P_SAME.copy()),
    "dirichlet": _dirichlet_pair(),
}
BUDGETS = (0.0, 0.1, 0.3, 0.5, 1.0)
N_SAMPLES = {"disjoint": 20_000, "same": 10_000, "dirichlet": 20_000}
_SEED_BASE = {"disjoint": 11, "same": 23, "dirichlet": 37}


@functools.lru_cache(maxsize=None)
def _simulate(pair: str, budget: float) -> dict:
    """Draw x ~ q, verify each with verify_sampled; collect output counts and verdicts."""
    p_np, q_np = PAIRS[pair]
    p = torch.tensor(p_np, dtype=torch.float32)
    q = torch.tensor(q_np, dtype=torch.float32)
    n = N_SAMPLES[pair]
    seed = 1000 * _SEED_BASE[pair] + int(round(budget * 100))
    draft_gen = torch.Generator().manual_seed(seed)
    verify_gen = torch.Generator().manual_seed(seed + 7)
    drafts = torch.multinomial(q, n, replacement=True, generator=draft_gen).tolist()
    counts = np.zeros(len(p_np), dtype=np.int64)
    accepted = 0
    accepted_token_mismatch = 0
    tvs = set()
    bad_types = 0
    for x in drafts:
        v = verify_sampled(p, q, x, budget, verify_gen)
        if not isinstance(v, Verdict) or not isinstance(v.token, int):
            bad_types += 1
        counts[v.token] += 1
        if v.accepted:
            accepted += 1
            if v.token != x:
                accepted_token_mismatch += 1
        tvs.add(v.tv)
    return {"counts": counts, "accepted": accepted, "n": n, "tvs": tvs,
            "accepted_token_mismatch": accepted_token_mismatch, "bad_types": bad_types}


# p == q needs only one intermediate budget
CASES = [(pair, b) for pair in PAIRS for b in BUDGETS if pair != "same" or b in (0.0, 0.5, 1.0)]


@pytest.mark.parametrize("pair,budget", CASES)
def test_verify_sampled_output_distribution_is_mixture(pair, budget):
    """Output tokens follow π: p at D=0, the θ-mixture for 0<D<1, q at D=1 (chi-square)."""
    p_np, q_np = PAIRS[pair]
    pi = _np_mixture(p_np, q_np, budget)
    if budget == 0.0:
        np.testing.assert_allclose(pi, p_np)
    if budget == 1.0:
        np.testing.assert_allclose(pi, q_np)
    if pair != "same":
        assert _np_tv(p_np, q_np) > 0.5  # so every budget below 1 gives a proper mixture
    r = _simulate(pair, budget)
    # the test is only valid with enough expected counts in every possible category
    assert r["n"] * pi[pi > 0].min() >= 5
    assert r["bad_types"] == 0
    assert r["counts"].sum() == r["n"]
    # impossible outputs (π(x) = 0) must never appear
    assert r["counts"][pi == 0].sum() == 0, (r["counts"], pi)
    pval = _chi2_pvalue(r["counts"], pi)
    assert pval > 1e-4, f"{pair} D={budget}: counts {r['counts'].tolist()} vs π {pi.round(4).tolist()}, p={pval:.3g}"


@pytest.mark.parametrize("pair,budget", CASES)
def test_verify_sampled_acceptance_rate_and_tv(pair, budget):
    """Acceptance rate is 1 − max(0, d − D); Verdict.tv is TV(p, q); accepted ⇒ token is the draft."""
    p_np, q_np = PAIRS[pair]
    d = _np_tv(p_np, q_np)
    r = _simulate(pair, budget)
    n = r["n"]
    a = 1.0 - max(0.0, d - budget)
    se = math.sqrt(a * (1.0 - a) / n)
    rate = r["accepted"] / n
    assert abs(rate - a) <= 5 * se + 1e-12, f"{pair} D={budget}: rate {rate} vs exact {a} (se {se:.2g})"
    if a == 1.0:
        assert r["accepted"] == n  # every draft token must be accepted, not just most
    assert r["accepted_token_mismatch"] == 0
    assert len(r["tvs"]) == 1
    (tv,) = r["tvs"]
    assert tv == pytest.approx(d, abs=2e-6)


def test_verify_sampled_chi_square_has_power_against_wrong_target():
    """The chi-square check rejects wrong targets: D=0.5 output vs p, and D=0.3 output vs the
    D=0.25 / D=0.35 mixtures (only TV 0.05 away), so a budget mishandled by 0.05 is caught."""
    for pair in ("disjoint", "dirichlet"):
        p_np, q_np = PAIRS[pair]
        pi = _np_mixture(p_np, q_np, 0.5)
        assert _np_tv(pi, p_np) == pytest.approx(0.5)  # the targets really differ
        r = _simulate(pair, 0.5)
        assert _chi2_pvalue(r["counts"], p_np) < 1e-6
        assert _chi2_pvalue(r["counts"], pi) > 1e-4
        r3 = _simulate(pair, 0.3)
        for near in (0.25, 0.35):
            assert _np_tv(_np_mixture(p_np, q_np, near), _np_mixture(p_np, q_np, 0.3)) == pytest.approx(0.05)
            assert _chi2_pvalue(r3["counts"], _np_mixture(p_np, q_np, near)) < 1e-6
    # and the lossless (D=0) output is distinguishable from q
    p_np, q_np = PAIRS["dirichlet"]
    assert _chi2_pvalue(_simulate("dirichlet", 0.0)["counts"], q_np) < 1e-6


def test_verify_sampled_one_hot_cases_are_deterministic():
    """One-hot p and q: D=0 always rejects and replaces with p's token; D=1 always accepts."""
    p = torch.tensor([1.0, 0.0, 0.0, 0.0])
    q = torch.tensor([0.0, 1.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        assert verify_sampled(p, q, 1, 0.0, g) == Verdict(False, 0, 1.0)
        assert verify_sampled(p, q, 1, 1.0, g) == Verdict(True, 1, 1.0)
    # D = 0.5: π = (½, ½), accept x=1 with probability ½, otherwise 0
    outs = [verify_sampled(p, q, 1, 0.5, g) for _ in range(4000)]
    assert {(v.accepted, v.token) for v in outs} == {(True, 1), (False, 0)}
    frac = sum(v.accepted for v in outs) / len(outs)
    assert abs(frac - 0.5) < 5 * math.sqrt(0.25 / len(outs))


# --- exact math ----------------------------------------------------------------------


def _random_pair(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    p = rng.dirichlet(np.full(vocab, 0.7))
    q = rng.dirichlet(np.full(vocab, 0.7))
    # sparsify one of them sometimes, so supports differ
    if rng.random() < 0.5:
        q[rng.integers(vocab)] = 0.0
        q /= q.sum()
    return p, q


def test_tv_distance_matches_numpy():
    """tv_distance equals ½ Σ |p − q| computed independently."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        p, q = _random_pair(rng, int(rng.integers(2, 12)))
        assert tv_distance(torch.tensor(p), torch.tensor(q)) == pytest.approx(_np_tv(p, q), abs=1e-12)
    assert tv_distance(torch.tensor(_P_DISJOINT), torch.tensor(_Q_DISJOINT)) == pytest.approx(0.65, abs=1e-12)
    assert tv_distance(torch.tensor(_P_SAME), torch.tensor(_P_SAME)) == 0.0


def test_mentored_mixture_endpoints():
    """D=0 returns p, D ≥ d returns q, p == q gives d = 0 and π = q (θ = 1)."""
    rng = np.random.default_rng(6)
    for _ in range(10):
        p_np, q_np = _random_pair(rng, 8)
        p, q = torch.tensor(p_np), torch.tensor(q_np)
        d_exact = _np_tv(p_np, q_np)
        pi, d = mentored_mixture(p, q, 0.0)
        assert torch.equal(pi, p)
        assert d == pytest.approx(d_exact, abs=1e-12)
        for budget in (min(1.0, d_exact + 1e-3), 1.0):
            pi, d = mentored_mixture(p, q, budget)
            np.testing.assert_allclose(pi.numpy(), q_np, rtol=0, atol=1e-12)
            assert d == pytest.approx(d_exact, abs=1e-12)
    p = torch.tensor(_P_SAME)
    for budget in (0.0, 0.3, 1.0):
        pi, d = mentored_mixture(p, p.clone(), budget)
        assert d == 0.0
        np.testing.assert_array_equal(pi.numpy(), _P_SAME)


def test_mentored_mixture_tv_identities():
    """For random pairs: π is the θ-mixture, TV(π, p) = min(d, D), TV(π, q) = max(0, d − D)."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        vocab = int(rng.integers(2, 16))
        p_np, q_np = _random_pair(rng, vocab)
        d = _np_tv(p_np, q_np)
        for budget in (0.0, 0.05, 0.1, 0.3, 0.5, 0.9, 1.0, float(rng.random())):
            pi, dd = mentored_mixture(torch.tensor(p_np), torch.tensor(q_np), budget)
            pi_np = pi.numpy()
            np.testing.assert_allclose(pi_np, _np_mixture(p_np, q_np, budget), rtol=0, atol=1e-12)
            assert dd == pytest.approx(d, abs=1e-12)
            assert pi_np.min() >= -1e-15
            assert pi_np.sum() == pytest.approx(1.0, abs=1e-12)
            assert _np_tv(pi_np, p_np) == pytest.approx(min(d, budget), abs=1e-12)
            assert _np_tv(pi_np, q_np) == pytest.approx(max(0.0, d - budget), abs=1e-12)


def test_mentored_mixture_exact_fraction_example():
    """A hand-worked example: p=(.5,.5,0), q=(0,.5,.5), d=.5, D=.2 → θ=.4, π=(.3,.5,.2)."""
    from fractions import Fraction as F

    p = [F(1, 2), F(1, 2), F(0)]
    q = [F(0), F(1, 2), F(1, 2)]
    d = sum(abs(a - b) for a, b in zip(p, q)) / 2
    theta = min(F(1), F(1, 5) / d)
    expected = [(1 - theta) * a + theta * b for a, b in zip(p, q)]
    assert expected == [F(3, 10), F(1, 2), F(1, 5)]
    pi, dd = mentored_mixture(torch.tensor([float(x) for x in p], dtype=torch.float64),
                              torch.tensor([float(x) for x in q], dtype=torch.float64), 0.2)
    assert dd == pytest.approx(float(d), abs=1e-15)
    np.testing.assert_allclose(pi.numpy(), [float(x) for x in expected], rtol=0, atol=1e-15)


# --- greedy --------------------------------------------------------------------------


def test_verify_greedy():
    """Greedy: accepted iff the draft token is the target's choice; the token is always the target's."""
    assert verify_greedy(7, 7) == Verdict(True, 7, None)
    assert verify_greedy(7, 3) == Verdict(False, 7, None)
    assert verify_greedy(0, 1) == Verdict(False, 0, None)
    for target in range(5):
        for token in range(5):
            v = verify_greedy(target, token)
            assert v.accepted == (target == token)
            assert v.token == target
            assert v.tv is None


# --- draft-length policies -----------------------------------------------------------


def test_fixed_length_never_changes():
    """FixedLength keeps k whatever the rounds say."""
    f = FixedLength(5)
    for accepted, proposed in ((0, 5), (5, 5), (2, 5), (0, 0)):
        f.update(accepted, proposed)
        assert f.current() == 5


def test_acceptance_rate_length_rules():
    """Original rules (init 4, 0.4/0.8, [1, 8]): <0.4 → k−1, >0.8 → k+1, threshold → same."""
    a = AcceptanceRateLength()
    assert a.current() == 4
    a.update(1, 4)  # 0.25 < 0.4
    assert a.current() == 3
    a.update(3, 3)  # 1.0 > 0.8
    assert a.current() == 4
    a.update(2, 5)  # exactly 0.4: unchanged
    assert a.current() == 4
    a.update(4, 5)  # exactly 0.8: unchanged
    assert a.current() == 4
    a.update(3, 5)  # 0.6 in between: unchanged
    assert a.current() == 4
    a.update(0, 0)  # nothing proposed: ignored
    a.update(3, 0)
    assert a.current() == 4
    a.update(9, 10)  # 0.9 > 0.8
    assert a.current() == 5


def test_acceptance_rate_length_clamps():
    """k never leaves [min, max]."""
    a = AcceptanceRateLength()
    for _ in range(10):
        a.update(0, a.current())
    assert a.current() == 1
    a.update(0, 1)
    assert a.current() == 1
    for _ in range(20):
        a.update(a.current(), a.current())
    assert a.current() == 8
    b = AcceptanceRateLength(2, 0.3, 0.9, 2, 3)
    b.update(0, 2)
    assert b.current() == 2
    b.update(2, 2)
    b.update(3, 3)
    b.update(3, 3)
    assert b.current() == 3


def test_accepted_length_documented_example():
    """'from 4, update(0,4) -> 3, then update(2,3) -> 3' (init 4, alpha 0.2, [1, 8])."""
    a = AcceptedLengthAverage()
    assert a.current() == 4
    a.update(0, 4)  # s = 0.8 * 3 = 2.4 → round 2 → k 3
    assert a.current() == 3
    a.update(2, 3)  # s = 0.4 + 0.8 * 2.4 = 2.32 → round 2 → k 3
    assert a.current() == 3
    a.update(0, 0)  # nothing proposed: ignored
    assert a.current() == 3


def test_accepted_length_matches_reference_sequence():
    """A longer sequence against s ← αa + (1−α)s, k = clamp(⌊s + ½⌋ + 1, 1, 8), in exact fractions."""
    from fractions import Fraction as F

    rng = np.random.default_rng(11)
    a = AcceptedLengthAverage()
    s = F(3)
    alpha = F(1, 5)
    for _ in range(60):
        proposed = a.current()
        accepted = int(rng.integers(0, proposed + 1))
        a.update(accepted, proposed)
        s = alpha * accepted + (1 - alpha) * s
        k = min(max(math.floor(s + F(1, 2)) + 1, 1), 8)
        if abs(s - math.floor(s) - F(1, 2)) > F(1, 10**9):  # skip float-vs-exact ties
            assert a.current() == k, (float(s), a.current(), k)


def test_accepted_length_rounds_half_up_and_clamps():
    """s = 2.5 rounds up to 3 (k = 4); long runs of 0 / full acceptance clamp to 1 / 8."""
    a = AcceptedLengthAverage(4, 0.5, 1, 8)  # s starts at 3
    a.update(2, 4)  # s = 0.5*2 + 0.5*3 = 2.5 exactly
    assert a.current() == 4
    for _ in range(40):
        a.update(0, a.current())
    assert a.current() == 1
    for _ in range(40):
        a.update(8, 8)
    assert a.current() == 8


# --- parse_draft_policy --------------------------------------------------------------


def test_parse_fixed():
    """'fixed:6' gives 6 ungated; 'fixed' takes num_draft_tokens."""
    pol = parse_draft_policy("fixed:6")
    c = pol.new_controller()
    assert isinstance(c.length, FixedLength) and c.gate is None and pol.gated is False
    assert c.wanted() == 6
    c2 = parse_draft_policy("fixed", num_draft_tokens=5).new_controller()
    assert c2.wanted() == 5
    assert parse_draft_policy("fixed", num_draft_tokens=MAX_DRAFT_TOKENS).new_controller().wanted() == MAX_DRAFT_TOKENS


def test_parse_acceptance_rate_with_arguments():
    """'acceptance-rate:2,0.3,0.9,1,6': init 2, thresholds 0.3/0.9, range [1, 6]."""
    c = parse_draft_policy("acceptance-rate:2,0.3,0.9,1,6").new_controller()
    assert isinstance(c.length, AcceptanceRateLength) and c.gate is None
    assert c.wanted() == 2
    c.length.update(1, 3)  # 0.33 > 0.3: unchanged (the default 0.4 would shrink)
    assert c.wanted() == 2
    c.length.update(17, 20)  # 0.85 < 0.9: unchanged (the default 0.8 would grow)
    assert c.wanted() == 2
    c.length.update(1, 4)  # 0.25 < 0.3
    assert c.wanted() == 1
    for _ in range(10):
        c.length.update(c.wanted(), c.wanted())
    assert c.wanted() == 6


def test_parse_accepted_length_default():
    """'accepted-length' starts at num_draft_tokens with alpha 0.2, ungated."""
    c = parse_draft_policy("accepted-length", num_draft_tokens=4).new_controller()
    assert isinstance(c.length, AcceptedLengthAverage) and c.gate is None
    assert c.wanted() == 4
    c.length.update(0, 4)
    assert c.wanted() == 3  # the documented example
    c.length.update(2, 3)
    assert c.wanted() == 3


def test_parse_gated_policies():
    """'adaptive' is acceptance-rate behind a gate; '<policy>+gate' gates that policy."""
    pol = parse_draft_policy("adaptive")
    assert pol.gated is True
    c = pol.new_controller()
    assert isinstance(c.length, AcceptanceRateLength) and isinstance(c.gate, PayoffGate)
    assert c.length.current() == 4
    pol = parse_draft_policy("accepted-length+gate")
    assert pol.gated is True
    c = pol.new_controller()
    assert isinstance(c.length, AcceptedLengthAverage) and isinstance(c.gate, PayoffGate)
    c = parse_draft_policy("fixed:3+gate").new_controller()
    assert isinstance(c.length, FixedLength) and c.length.current() == 3 and isinstance(c.gate, PayoffGate)


def test_new_controller_gives_independent_state():
    """Each request's controller has its own length and gate state."""
    pol = parse_draft_policy("adaptive")
    a, b = pol.new_controller(), pol.new_controller()
    a.length.update(0, 4)
    assert a.length.current() == 3 and b.length.current() == 4
    assert a.gate is not b.gate


@pytest.mark.parametrize("spec", ["fixed:0", "fixed:x", "bogus", "acceptance-rate:4,0.9,0.4", "", "   ",
                                  "fixed:33", "fixed:1,2", "accepted-length:4,0", "+gate", None])
def test_parse_invalid_specs_raise_config_error(spec):
    """Invalid specs raise ConfigError whose field and message name draft_policy."""
    with pytest.raises(ConfigError) as info:
        parse_draft_policy(spec)
    assert info.value.field == "draft_policy"
    assert "draft_policy" in str(info.value)


@pytest.mark.parametrize("spec", ["fixed:0", "fixed:33", "acceptance-rate:9,0.4,0.8,1,8",
                                  "accepted-length:4,0.2,1,40"])
def test_parse_out_of_range_message_states_the_limit(spec):
    """An out-of-range draft length gets the specific message that states the limit [1, 32].

    draft_policy.py builds such messages (in _check_count and the range checks), but they
    are raised inside `try: ... except ValueError:` and ConfigError subclasses ValueError,
    so they are replaced by the generic help text.
    """
    with pytest.raises(ConfigError) as info:
        parse_draft_policy(spec)
    assert str(MAX_DRAFT_TOKENS) in str(info.value), str(info.value)


# --- pay-off gate --------------------------------------------------------------------

# plain: 1 token in 0.1 s = 10 tok/s
PLAIN = (1, 0.1)
# a round of 2 tokens in 0.4 s = 5 tok/s (slower than plain); 6 tokens in 0.2 s = 30 tok/s
SLOW_ROUND = (2, 0.4)
FAST_ROUND = (6, 0.2)


def _gate_to_speculating(**kw) -> PayoffGate:
    g = PayoffGate(**kw)
    assert g.state == "baseline" and not g.speculating
    g.record_plain(*PLAIN)
    assert g.state == "baseline"
    g.record_plain(*PLAIN)
    assert g.state == "speculating" and g.speculating
    return g


def test_gate_baseline_then_speculating():
    """The gate starts in baseline and speculates after 2 measured plain steps."""
    _gate_to_speculating()


def test_gate_pauses_after_failed_probe_and_resumes_after_pause_tokens():
    """5 tok/s rounds vs 10 tok/s plain pause after probe_rounds; resume after `pause` tokens."""
    g = _gate_to_speculating()
    for _ in range(g.probe_rounds - 1):
        g.record_round(*SLOW_ROUND)
        assert g.state == "speculating"
    g.record_round(*SLOW_ROUND)
    assert g.state == "paused" and not g.speculating
    assert g.pauses == 1
    assert g.pause == 32  # the first pause
    # rounds while paused are ignored
    g.record_round(*FAST_ROUND)
    assert g.state == "paused"
    for _ in range(31):
        g.record_plain(*PLAIN)
        assert g.state == "paused"
    g.record_plain(*PLAIN)
    assert g.state == "speculating"


def test_gate_second_failed_probe_doubles_pause_up_to_max():
    """Each further failed probe grows the pause fourfold (32 → 128 → 512), capped at max_pause."""
    g = _gate_to_speculating(max_pause=600)
    expected_pauses = [32, 128, 512, 600, 600]
    for i, pause in enumerate(expected_pauses):
        for _ in range(3):
            g.record_round(*SLOW_ROUND)
        assert g.state == "paused"
        assert g.pauses == i + 1
        assert g.pause == pause
        for _ in range(pause - 1):
            g.record_plain(*PLAIN)
        assert g.state == "paused", f"pause {i + 1} ended before {pause} tokens"
        g.record_plain(*PLAIN)
        assert g.state == "speculating"


def test_gate_counts_paused_tokens_not_steps():
    """The pause is measured in tokens: 4-token plain steps end a 32-token pause in 8 steps."""
    g = _gate_to_speculating()
    for _ in range(3):
        g.record_round(*SLOW_ROUND)
    assert g.state == "paused"
    for _ in range(7):
        g.record_plain(4, 0.4)
    assert g.state == "paused"
    g.record_plain(4, 0.4)
    assert g.state == "speculating"


def test_gate_a_clear_loss_pauses_after_one_round():
    """A probe round below abort_ratio x the plain rate (2 tok/s vs 10) pauses at once; after
    the probe window (probe_rounds measured rounds) only the averaged comparison counts."""
    g = _gate_to_speculating()
    g.record_round(1, 0.5)
    assert g.state == "paused" and g.pauses == 1
    g = _gate_to_speculating()
    for _ in range(g.probe_rounds):
        g.record_round(*FAST_ROUND)
    g.record_round(1, 0.5)  # one bad round after a paying probe: the average still pays
    assert g.state == "speculating"


def test_gate_an_unmeasured_probe_round_that_accepted_nothing_pauses():
    """A probe round yielding one token is a loss whatever its time, measured or not; after
    a paying probe such a round no longer decides alone."""
    g = _gate_to_speculating()
    g.record_round(1, 0.01, measured=False)
    assert g.state == "paused"
    g = _gate_to_speculating()
    for _ in range(g.probe_rounds):
        g.record_round(*FAST_ROUND)
    g.record_round(1, 0.01, measured=False)
    assert g.state == "speculating"


def test_gate_fast_rounds_never_pause():
    """Rounds at 30 tok/s against 10 tok/s plain never pause."""
    g = _gate_to_speculating()
    for _ in range(200):
        g.record_round(*FAST_ROUND)
        assert g.state == "speculating"
    assert g.pauses == 0


def test_gate_unmeasured_samples_do_not_count():
    """measured=False plain steps do not end the baseline; measured=False rounds do not probe."""
    g = PayoffGate()
    for _ in range(5):
        g.record_plain(1, 0.001, measured=False)  # would be 1000 tok/s if it counted
    assert g.state == "baseline"
    g.record_plain(*PLAIN)
    assert g.state == "baseline"
    g.record_plain(*PLAIN)
    assert g.state == "speculating"
    for _ in range(10):
        g.record_round(2, 20.0, measured=False)  # 0.1 tok/s if it counted
    assert g.state == "speculating"
    g.record_round(*SLOW_ROUND)
    g.record_round(*SLOW_ROUND)
    assert g.state == "speculating"  # only 2 measured rounds so far
    g.record_round(*SLOW_ROUND)
    assert g.state == "paused"


def test_gate_unmeasured_plain_does_not_change_plain_rate():
    """An unmeasured fast plain step cannot make fast-enough rounds look slow."""
    g = _gate_to_speculating()
    g.record_plain(100, 0.001, measured=False)
    for _ in range(10):
        g.record_round(3, 0.2)  # 15 tok/s > 10 tok/s plain
    assert g.state == "speculating"


def test_draft_controller_wanted_follows_gate():
    """wanted() is 0 outside speculating (baseline, paused) and the policy's k while speculating."""
    length = AcceptanceRateLength()
    c = DraftController(length, PayoffGate())
    assert c.wanted() == 0  # baseline
    c.gate.record_plain(*PLAIN)
    c.gate.record_plain(*PLAIN)
    assert c.wanted() == 4
    length.update(0, 4)
    assert c.wanted() == 3
    for _ in range(3):
        c.gate.record_round(*SLOW_ROUND)
    assert c.gate.state == "paused"
    assert c.wanted() == 0
    for _ in range(32):
        c.gate.record_plain(*PLAIN)
    assert c.wanted() == 3
    ungated = DraftController(FixedLength(6), None)
    assert ungated.wanted() == 6


# --- EngineConfig ---------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("num_draft_tokens", 0), ("num_draft_tokens", 33), ("num_draft_tokens", "a"),
    ("tv_budget", -0.1), ("tv_budget", 1.5), ("tv_budget", True), ("tv_budget", "x"),
    ("draft_policy", "nope"),
])
def test_engine_config_rejects_bad_spec_fields(field, value):
    """Invalid speculative-decoding settings raise ConfigError naming the field."""
    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value})
    assert info.value.field == field
    assert field in str(info.value)


def test_engine_config_spec_defaults_and_bounds():
    """Defaults: 'fixed', k=4, lossless; the bounds 1/32 and 0/1 are accepted."""
    cfg = EngineConfig()
    assert cfg.draft_policy == "fixed"
    assert cfg.num_draft_tokens == 4
    assert cfg.tv_budget == 0.0
    assert EngineConfig(num_draft_tokens=1).num_draft_tokens == 1
    assert EngineConfig(num_draft_tokens=MAX_DRAFT_TOKENS).num_draft_tokens == MAX_DRAFT_TOKENS
    assert EngineConfig(tv_budget=0).tv_budget == 0
    assert EngineConfig(tv_budget=1.0).tv_budget == 1.0
    assert EngineConfig(tv_budget=0.25, draft_policy="accepted-length+gate").draft_policy == "accepted-length+gate"


# --- SpecStats -----------------------------------------------------------------------


def test_spec_stats_record_round_and_as_dict():
    """Counters, acceptance rate, string histogram keys, TV mean/max from recorded rounds."""
    s = SpecStats()
    empty = s.as_dict()
    assert empty["acceptance_rate"] is None and empty["tv_mean"] is None and empty["tv_max"] is None
    assert empty["draft_length_histogram"] == {}
    s.record_round(4, 3, False, [0.1, 0.2, 0.3, 0.4])
    s.record_round(4, 4, True, [0.0, 0.5, 0.1, 0.2])
    s.record_round(2, 0, False, [0.9, 0.3])
    s.plain_steps += 5
    d = s.as_dict()
    assert d["proposed"] == 10
    assert d["accepted"] == 7
    assert d["acceptance_rate"] == pytest.approx(0.7)
    assert d["bonus_tokens"] == 1
    assert d["rounds"] == 3
    assert d["plain_steps"] == 5
    assert d["draft_length_histogram"] == {"2": 1, "4": 2}
    assert list(d["draft_length_histogram"]) == ["2", "4"]
    tvs = [0.1, 0.2, 0.3, 0.4, 0.0, 0.5, 0.1, 0.2, 0.9, 0.3]
    assert d["tv_mean"] == pytest.approx(sum(tvs) / len(tvs))
    assert d["tv_max"] == pytest.approx(0.9)


def test_spec_stats_merge():
    """merge adds counters and histograms and keeps the larger TV max."""
    a = SpecStats()
    a.record_round(3, 1, False, [0.2, 0.4, 0.6])
    a.plain_steps = 2
    b = SpecStats()
    b.record_round(3, 3, True, [0.1])
    b.record_round(5, 2, False, [0.3, 0.8])
    b.plain_steps = 4
    a.merge(b)
    d = a.as_dict()
    assert (d["proposed"], d["accepted"], d["bonus_tokens"], d["rounds"], d["plain_steps"]) == (11, 6, 1, 3, 6)
    assert d["acceptance_rate"] == pytest.approx(6 / 11)
    assert d["draft_length_histogram"] == {"3": 2, "5": 1}
    assert d["tv_mean"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.1 + 0.3 + 0.8) / 6)
    assert d["tv_max"] == pytest.approx(0.8)
    # merging an empty one changes nothing; merging into an empty one copies
    before = a.as_dict()
    a.merge(SpecStats())
    assert a.as_dict() == before
    c = SpecStats()
    c.merge(a)
    assert c.as_dict() == before
