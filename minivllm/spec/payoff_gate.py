"""The pay-off gate: a request speculates only while that measurably beats decoding
without the draft, and probes again later when it stops.

Adaptive policies alone can only shrink proposals to one token: on creative text even
one-token rounds lost to the target alone (0.63x), because a round always pays a draft
forward and a wider verification forward.

Per request, in the batch it actually runs in, the gate compares two measured rates:
  plain       tokens per second of its decode steps without the draft (1 token per step);
  speculative tokens per second of its rounds (accepted + 1 tokens per draft forwards +
              verification forward).
Both are exponential averages of (tokens, seconds) pairs, so a rate is a ratio of sums,
not an average of noisy ratios. Steps that also ran a prefill chunk, and rounds whose
draft had to catch up more than two tokens (its first round computes the whole prompt),
are not measured: they say more about the prompt than about speculation.

States: baseline (the first `baseline_steps` decode steps run plain to measure the plain
rate) -> speculating (after `probe_rounds` measured rounds, pause as soon as the
speculative rate falls below the plain rate; a single round below `abort_ratio` of the
plain rate is a clear loss and pauses at once, and so does a probe round that accepted
nothing even when its time is not measured) -> paused (plain steps for `pause` tokens,
refreshing the plain rate) -> speculating again with fresh measurements. Each pause
that follows a failed probe grows `growth`-fold, up to `max_pause`, so text where the
draft never helps costs a couple of rounds per probe and few probes; a probe that pays
resets it. On the H200 a round that accepts nothing costs about five plain decode steps
(an eager verification forward against a CUDA-graph decode step), which is what these
defaults were tuned against (benchmarks/results/speculative-*synthetic*).
"""

from __future__ import annotations


class _Rate:
    def __init__(self, alpha: float):
        self.alpha = alpha
        self.tokens = 0.0
        self.seconds = 0.0
        self.samples = 0

    def add(self, tokens: int, seconds: float) -> None:
        a = 1.0 if self.samples == 0 else self.alpha
        self.tokens = a * tokens + (1 - a) * self.tokens
        self.seconds = a * seconds + (1 - a) * self.seconds
        self.samples += 1

    @property
    def value(self) -> float | None:
        return self.tokens / self.seconds if self.samples and self.seconds > 0 else None


class PayoffGate:
    def __init__(self, *, baseline_steps: int = 2, probe_rounds: int = 3, abort_ratio: float = 0.5,
                 first_pause: int = 32, growth: int = 4, max_pause: int = 1024, alpha: float = 0.3):
        self.baseline_steps = baseline_steps
        self.probe_rounds = probe_rounds
        self.abort_ratio = abort_ratio
        self.growth = growth
        self.first_pause = first_pause
        self.max_pause = max_pause
        self.alpha = alpha
        self.state = "baseline" if baseline_steps > 0 else "speculating"
        self.plain = _Rate(alpha)
        self.spec = _Rate(alpha)
        self.pause = first_pause
        self.paused_tokens = 0
        self.pauses = 0  # how many times this request stopped speculating

    @property
    def speculating(self) -> bool:
        return self.state == "speculating"

    def record_plain(self, tokens: int, seconds: float, *, measured: bool = True) -> None:
        if measured and seconds > 0:
            self.plain.add(tokens, seconds)
        if self.state == "baseline" and self.plain.samples >= self.baseline_steps:
            self._start_probe()
        elif self.state == "paused":
            self.paused_tokens += tokens
            if self.paused_tokens >= self.pause:
                self._start_probe()

    def record_round(self, tokens: int, seconds: float, *, measured: bool = True) -> None:
        if self.state != "speculating":
            return
        probing = self.spec.samples < self.probe_rounds
        if not measured or seconds <= 0:
            # Its time says little, but a round that got a single token (nothing accepted)
            # cost a plain step plus the draft's work whatever the time: a loss.
            if probing and tokens <= 1:
                self._pause(probing=True)
            return
        self.spec.add(tokens, seconds)
        plain, spec = self.plain.value, self.spec.value
        if plain is None or spec is None:
            return
        clear_loss = tokens / seconds < self.abort_ratio * plain
        if (self.spec.samples >= self.probe_rounds and spec < plain) or (probing and clear_loss):
            self._pause(probing=probing or self.spec.samples == self.probe_rounds)
        elif self.spec.samples == self.probe_rounds:
            self.pause = self.first_pause  # the probe paid: a later pause starts short again

    def _pause(self, *, probing: bool) -> None:
        self.state = "paused"
        self.paused_tokens = 0
        self.pauses += 1
        if probing and self.pauses > 1:  # the probe itself failed again: back off further
            self.pause = min(self.pause * self.growth, self.max_pause)

    def _start_probe(self) -> None:
        self.state = "speculating"
        self.spec = _Rate(self.alpha)

    def describe(self) -> dict:
        return {"state": self.state, "plain_tokens_per_s": self.plain.value,
                "speculative_tokens_per_s": self.spec.value, "pauses": self.pauses, "next_pause_tokens": self.pause}
