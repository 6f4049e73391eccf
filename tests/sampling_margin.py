"""How close one sampling decision was to another outcome, in logit units.

A greedy token flips between two code paths only where the reference's top-1/top-2
logit margin is below what the paths' rounding can move (tests compare tokens up to the
first such near-tie). A seeded draw has the same kind of margin: torch.multinomial(p, 1,
generator) is argmax_i p_i / E_i with E_i ~ Exp(1) drawn from the generator (checked
against torch on every call), so with the generator's state fixed the token is the argmax
of log p_i - log E_i over the kept tokens, and the filters (top-k, top-p, min-p) decide
which tokens are kept by comparisons with thresholds. `draw_margin` returns the smallest
of those gaps, scaled like a greedy margin (twice the per-logit change that could alter
the outcome): a draw whose margin is above NEAR_TIE must come out the same on any path
whose logits are within NEAR_TIE / 2 of the reference's.
"""

from __future__ import annotations

import math

import torch

from minivllm import SamplingParams
from minivllm.sampling.sampler import apply_penalties, filtered_probs, sample


def _clone(generator: torch.Generator) -> torch.Generator:
    g = torch.Generator(device=generator.device)
    g.set_state(generator.get_state())
    return g


def _log_ratio(a: float, b: float) -> float:
    return math.inf if b <= 0 else (math.inf if a <= 0 else abs(math.log(a / b)))


def draw_margin(logits: torch.Tensor, context_ids: list[int], output_ids: list[int], params: SamplingParams,
                generator: torch.Generator | None) -> float:
    """The margin of the token `sample(logits, ...)` picks with `generator` in its current
    state (the state is not advanced). Greedy: the top-1/top-2 gap of the penalised logits."""
    penalized = apply_penalties(logits.clone(), context_ids, output_ids, params).float()
    # A repetition penalty multiplies a seen negative logit by up to max(rp, 1/rp): a
    # change of d in the raw logit is at most that times d after it.
    rp = params.repetition_penalty
    stretch = max(rp, 1.0 / rp) if rp != 1.0 and context_ids else 1.0
    if params.greedy:
        top = torch.topk(penalized, 2).values
        return float(top[0] - top[1]) / stretch
    t = max(params.temperature, torch.finfo(torch.float32).tiny)
    probs = filtered_probs(penalized.clone(), params)
    e = torch.empty_like(probs).exponential_(1, generator=_clone(generator))
    token = int(torch.argmax(probs / e))
    assert token == sample(logits, context_ids, output_ids, params, _clone(generator)), \
        "torch.multinomial is no longer argmax(p / Exp(1)) with this torch: draw_margin needs updating"
    # Every token's race score; only the kept ones take part.
    score = ((penalized - penalized.max()) / t - e.log()).tolist()
    kept = (probs > 0).tolist()
    win = score[token]
    others = [score[i] for i in range(len(score)) if kept[i] and i != token]
    gaps = [t * (win - max(others)) if others else math.inf]  # the race against the best other kept token
    # The filters: the winner could be cut (any one filter suffices), or a cut token let in
    # and then win the race (it must pass the filter that cut it, and overturn its score gap).
    # Letting a token in or out changes no other token's score.
    win_gaps: list[float] = []
    cut_gap: dict[int, float] = {}
    pen = penalized.tolist()
    if params.top_k and params.top_k < penalized.shape[-1]:
        v = torch.topk(penalized, params.top_k + 1).values
        kth, first_cut = float(v[-2]), float(v[-1])
        if params.top_p < 1.0:
            # which tokens top-k keeps renormalises what top-p sums: any swap at its boundary counts
            gaps.append(kth - first_cut)
        win_gaps.append(pen[token] - first_cut)
        cut_gap.update({i: kth - x for i, x in enumerate(pen) if x < kth})
    # The filters' probabilities in float64, so that none underflows to 0 here.
    scaled = (penalized.double() - float(penalized.max())) / t
    if params.top_k and params.top_k < penalized.shape[-1]:
        scaled = scaled.masked_fill(penalized < kth, float("-inf"))
    p = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        # Token i stays kept while the mass of the tokens above it stays below top_p. Under
        # logit changes of at most d, a ratio p_j / p_i moves by at most a factor e^(2d/T)
        # and so does the odds of any fixed set's mass: the tokens above i afterwards are
        # within those whose log-ratio to i exceeds -2d/T (and include those above +2d/T).
        # The largest d for which that bound keeps i's side of the cut, found by bisection
        # for every token at once, gives its gap (2d, like a greedy margin).
        d_safe = _top_p_safe_change(p, params.top_p, t)
        kept_p = _top_p_kept(p, params.top_p)
        win_gaps.append(2 * float(d_safe[token]))
        for i in (kept_p == 0).nonzero().flatten().tolist():
            if i not in cut_gap and float(p[i]) > 0:
                cut_gap[i] = 2 * float(d_safe[i])
        p = p * kept_p
    if params.min_p > 0.0:
        floor = params.min_p * float(p.max())
        win_gaps.append(t * _log_ratio(float(p[token]), floor))
        for i, x in enumerate(p.tolist()):
            if x < floor and i not in cut_gap:
                cut_gap[i] = t * _log_ratio(x, floor) if x > 0 else 0.0
    # Tokens cut in float32 by none of the above (their probability underflowed to 0 there)
    # could come in with any change: only their score gap holds them off.
    for i in range(len(score)):
        if not kept[i] and i not in cut_gap:
            cut_gap[i] = 0.0
    gaps += win_gaps
    gaps += [max(g, t * (win - score[i])) for i, g in cut_gap.items()]
    return min(gaps) / stretch


def _top_p_kept(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """1 where filtered_probs's top-p step keeps the token, else 0 (the same rule)."""
    sp, order = p.sort(descending=True)
    drop = (sp.cumsum(-1) - sp) >= top_p
    drop[0] = False
    keep = torch.ones_like(p)
    keep[order[drop]] = 0.0
    return keep


def _logodds(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return torch.log(x) - torch.log1p(-x.clamp(max=1.0))


def _top_p_safe_change(p: torch.Tensor, top_p: float, t: float, steps: int = 48) -> torch.Tensor:
    """Per token: the largest logit change d (bisected) under which its top-p membership
    provably cannot change. Tokens with p = 0 (cut earlier) get 0."""
    p = p.double()
    lp = torch.log(p)
    lp_sorted, order = lp.sort()
    suffix = torch.cat([p[order].flip(0).cumsum(0).flip(0), torch.zeros(1, dtype=torch.float64)])
    kept_now = _top_p_kept(p, top_p) > 0
    target = math.log(top_p) - math.log1p(-top_p)

    def mass_above(threshold: torch.Tensor) -> torch.Tensor:
        return suffix[torch.searchsorted(lp_sorted, threshold, right=True)]

    def safe(d: torch.Tensor) -> torch.Tensor:
        shift = 2 * d / t
        upper = (mass_above(lp - shift) - p).clamp(min=0.0)  # every token that could end up above i
        lower = mass_above(lp + shift)  # the tokens certainly still above i
        stays_kept = _logodds(upper) + shift < target
        stays_cut = _logodds(lower) - shift >= target
        return torch.where(kept_now, stays_kept, stays_cut)

    lo = torch.zeros_like(p)
    hi = torch.full_like(p, 64.0 * t)
    for _ in range(steps):
        mid = (lo + hi) / 2
        ok = safe(mid)
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    ok0 = safe(torch.zeros_like(p))
    return torch.where((p > 0) & ok0, lo, torch.zeros_like(p))
