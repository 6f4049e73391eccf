"""Accept or correct one draft token: lossless speculative sampling and its mentored
(TV-budget) relaxation.

Let p be the target's distribution and q the draft's at one position, both after the
request's penalties, temperature and top-k/top-p/min-p (the same processing on both),
and x ~ q the draft's token. With a total-variation budget D:

    d = TV(p, q) = ½ Σ |p − q|,   θ = min(1, D / d)  (θ = 1 when d = 0),
    π = (1 − θ) p + θ q,
    accept x with probability min(1, π(x) / q(x)),
    otherwise draw the replacement from normalise(max(p − q, 0)).

Why the output is exactly π: accepting contributes min(q, π); a rejection happens with
probability Σ max(q − π, 0) = TV(π, q) and, because π − q = (1 − θ)(p − q), the
residual max(p − q, 0) normalised equals max(π − q, 0) / TV(π, q), which contributes
max(π − q, 0). Their sum is π. D = 0 gives π = p (Leviathan et al.'s lossless rule);
D = 1 gives π = q, so every draft token is accepted. The per-token acceptance rate is
1 − max(0, d − D), and TV(π, p) = min(d, D) ≤ D.

Greedy requests verify by equality: x is accepted when it is the target's argmax, and
the replacement is that argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    token: int  # the draft token when accepted, else the replacement
    tv: float | None  # TV(p, q) at this position (None for greedy verification)


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(0.5 * (p - q).abs().sum())


def mentored_mixture(p: torch.Tensor, q: torch.Tensor, tv_budget: float) -> tuple[torch.Tensor, float]:
    """π = (1 − θ) p + θ q with θ = min(1, D / TV(p, q)); returns (π, TV(p, q))."""
    d = tv_distance(p, q)
    if tv_budget <= 0.0:
        return p, d
    theta = 1.0 if d == 0.0 else min(1.0, tv_budget / d)
    return (1.0 - theta) * p + theta * q, d


def verify_sampled(p: torch.Tensor, q: torch.Tensor, token: int, tv_budget: float,
                   generator: torch.Generator | None) -> Verdict:
    """One draft token `token` drawn from q, checked against p (and the budget)."""
    pi, d = mentored_mixture(p, q, tv_budget)
    qx = float(q[token])
    # x was drawn from q, so q(x) > 0; a zero (never in exact math) counts as a rejection.
    accept_prob = min(1.0, float(pi[token]) / qx) if qx > 0.0 else 0.0
    u = float(torch.rand((), generator=generator, device=p.device))
    if u < accept_prob:
        return Verdict(True, token, d)
    residual = torch.clamp(p - q, min=0.0)
    mass = float(residual.sum())
    # mass is 0 only when p == q, where every token is accepted; rounding can still
    # land here, and p itself is then the right distribution.
    dist = residual / mass if mass > 0.0 else p
    return Verdict(False, int(torch.multinomial(dist, 1, generator=generator)), d)


def verify_greedy(target_choice: int, token: int) -> Verdict:
    return Verdict(token == target_choice, target_choice, None)
