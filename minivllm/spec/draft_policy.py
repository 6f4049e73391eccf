"""How many tokens the draft proposes next, per request.

A policy spec (the `--draft-policy` option) names a factory; every request gets its own
controller from it, updated after each verification round with (accepted, proposed).

    fixed[:k]                              always k (default: num_draft_tokens)
    acceptance-rate[:init,dec,inc,min,max] the round's acceptance accepted/proposed below
                                           dec: k - 1; above inc: k + 1 (within [min, max];
                                           equal to a threshold: unchanged)
    accepted-length[:init,alpha,min,max]   s <- alpha*accepted + (1-alpha)*s, starting at
                                           init - 1; k = clamp(round(s) + 1, min, max): the
                                           +1 probes past the recently accepted prefix
    adaptive                               acceptance-rate behind the pay-off gate
    <any>+gate                             that policy behind the pay-off gate

The adaptive policies (defaults: init 4, thresholds 0.4/0.8, alpha 0.2, k in [1, 8]) can
only shrink k to 1, and on creative text even 1-token rounds lost to the
target alone. The pay-off gate (payoff_gate.py) lets a request stop speculating while it
measurably does not pay, and probe again later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minivllm.errors import ConfigError
from minivllm.spec.payoff_gate import PayoffGate

MAX_DRAFT_TOKENS = 32


class FixedLength:
    def __init__(self, k: int):
        self.k = k

    def current(self) -> int:
        return self.k

    def update(self, accepted: int, proposed: int) -> None:
        pass


class AcceptanceRateLength:
    def __init__(self, initial: int = 4, decrease_below: float = 0.4, increase_above: float = 0.8,
                 minimum: int = 1, maximum: int = 8):
        self.k, self.dec, self.inc, self.min, self.max = initial, decrease_below, increase_above, minimum, maximum

    def current(self) -> int:
        return self.k

    def update(self, accepted: int, proposed: int) -> None:
        if proposed <= 0:
            return
        rate = accepted / proposed
        if rate < self.dec:
            self.k = max(self.k - 1, self.min)
        elif rate > self.inc:
            self.k = min(self.k + 1, self.max)


class AcceptedLengthAverage:
    def __init__(self, initial: int = 4, smoothing: float = 0.2, minimum: int = 1, maximum: int = 8):
        self.alpha, self.min, self.max = smoothing, minimum, maximum
        self.s = float(initial - 1)
        self.k = initial

    def current(self) -> int:
        return self.k

    def update(self, accepted: int, proposed: int) -> None:
        if proposed <= 0:
            return
        self.s = self.alpha * accepted + (1 - self.alpha) * self.s
        # round half up (Python's round() would send 2.5 to 2, a shorter proposal than the rule says)
        self.k = min(max(int(self.s + 0.5) + 1, self.min), self.max)


@dataclass(frozen=True)
class DraftPolicy:
    """A parsed `--draft-policy`: `new_controller()` gives one request its own state."""

    name: str
    make_length: Callable[[], object]
    gated: bool

    def new_controller(self) -> "DraftController":
        return DraftController(self.make_length(), PayoffGate() if self.gated else None)


class DraftController:
    """One request's draft length: the length policy, optionally behind the gate."""

    def __init__(self, length, gate: PayoffGate | None):
        self.length = length
        self.gate = gate

    def wanted(self) -> int:
        """Tokens to propose in the next round (0: decode without the draft)."""
        if self.gate is not None and not self.gate.speculating:
            return 0
        return self.length.current()


def parse_draft_policy(spec: str, num_draft_tokens: int = 4) -> DraftPolicy:
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("draft_policy", spec, _HELP)
    text = spec.strip()
    gated = text.endswith("+gate")
    if gated:
        text = text[: -len("+gate")]
    if text == "adaptive":
        text, gated = "acceptance-rate", True
    name, _, args = text.partition(":")
    values = [a.strip() for a in args.split(",")] if args else []
    n = num_draft_tokens
    if name == "fixed":
        (k,) = _parse(spec, values, [n], [int])
        _check_count(spec, k)
        return DraftPolicy(spec, lambda: FixedLength(k), gated)
    if name == "acceptance-rate":
        init, dec, inc, lo, hi = _parse(spec, values, [n, 0.4, 0.8, 1, max(8, n)], [int, float, float, int, int])
        if not (0 < lo <= init <= hi <= MAX_DRAFT_TOKENS and 0 <= dec < inc <= 1):
            raise ConfigError("draft_policy", spec, "acceptance-rate needs 0 < min <= init <= max <= "
                              f"{MAX_DRAFT_TOKENS} and 0 <= dec < inc <= 1")
        return DraftPolicy(spec, lambda: AcceptanceRateLength(init, dec, inc, lo, hi), gated)
    if name == "accepted-length":
        init, alpha, lo, hi = _parse(spec, values, [n, 0.2, 1, max(8, n)], [int, float, int, int])
        if not (0 < lo <= init <= hi <= MAX_DRAFT_TOKENS and 0 < alpha <= 1):
            raise ConfigError("draft_policy", spec, "accepted-length needs 0 < min <= init <= max <= "
                              f"{MAX_DRAFT_TOKENS} and 0 < alpha <= 1")
        return DraftPolicy(spec, lambda: AcceptedLengthAverage(init, alpha, lo, hi), gated)
    raise ConfigError("draft_policy", spec, _HELP)


_HELP = ("allowed: fixed[:k], acceptance-rate[:init,dec,inc,min,max], accepted-length[:init,alpha,min,max], "
         "adaptive, and any of them with '+gate' (e.g. 'fixed:4', 'accepted-length+gate')")


def _check_count(spec: str, k: int) -> None:
    if not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ConfigError("draft_policy", spec, f"the draft length must be in [1, {MAX_DRAFT_TOKENS}]")


def _parse(spec: str, values: list[str], defaults: list, types: list) -> list:
    """The policy's arguments: given values converted, missing ones defaulted."""
    if len(values) > len(defaults):
        raise ConfigError("draft_policy", spec, f"takes at most {len(defaults)} arguments; {_HELP}")
    try:
        return [t(v) for v, t in zip(values, types)] + defaults[len(values):]
    except ValueError:
        raise ConfigError("draft_policy", spec, _HELP) from None
