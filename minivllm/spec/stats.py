"""Speculation counters: one `SpecStats` per request, one for the engine's totals."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    proposed: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, accepted
    bonus: int = 0  # tokens sampled from the target after a fully accepted proposal
    rounds: int = 0  # verification rounds (target forwards with a proposal)
    plain_steps: int = 0  # decode steps without the draft (the gate paused, or no room)
    draft_lengths: Counter = field(default_factory=Counter)  # proposal length -> rounds
    tv_sum: float = 0.0  # total variation between target and draft, summed over verified positions
    tv_count: int = 0
    tv_max: float = 0.0

    def record_round(self, proposed: int, accepted: int, bonus: bool, tvs: list[float]) -> None:
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        self.bonus += int(bonus)
        self.draft_lengths[proposed] += 1
        for d in tvs:
            self.tv_sum += d
            self.tv_count += 1
            self.tv_max = max(self.tv_max, d)

    def merge(self, other: "SpecStats") -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.bonus += other.bonus
        self.rounds += other.rounds
        self.plain_steps += other.plain_steps
        self.draft_lengths.update(other.draft_lengths)
        self.tv_sum += other.tv_sum
        self.tv_count += other.tv_count
        self.tv_max = max(self.tv_max, other.tv_max)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def as_dict(self) -> dict:
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "bonus_tokens": self.bonus,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "draft_length_histogram": {str(k): v for k, v in sorted(self.draft_lengths.items())},
            "tv_mean": self.tv_sum / self.tv_count if self.tv_count else None,
            "tv_max": self.tv_max if self.tv_count else None,
        }
