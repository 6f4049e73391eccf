"""What one step of the model runner produced: plain data, read by `Scheduler.update`.

The runner fills it and changes nothing else; the scheduler applies it (appends tokens,
finishes requests, moves KV tables). Errors are data too: a row whose draw or
verification failed carries a `RowError`; a forward that failed fails every row of the
step (`forward_error`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RowError:
    kind: str  # "constraint": the structured output cannot go on; "sampling" | "verification": anything else
    message: str


@dataclass
class DraftOutcome:
    """The draft model's side of one speculative row."""
    tokens: list[int]  # the proposal (may be shorter than asked: a stop token); empty if the draft failed
    q: list[torch.Tensor] | None  # the draft's distribution per token (sampled requests only)
    computed: int  # positions with draft K/V after the draft forwards
    catch_up: int  # tokens the first draft forward computed (what the draft had not seen)
    failed: bool = False  # the draft forward raised: its K/V may be half-written


@dataclass
class RowOutput:
    """One scheduled row that read logits. `tokens` in order: a plain row's drawn token,
    or a verification's accepted tokens then the replacement or the bonus token; with
    each, the logits it was decided at (what a logits hook reads: masked where a mask was
    computed) and its top log-probabilities when the request asked for them."""
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    logprobs: list[dict | None] = field(default_factory=list)
    round: object | None = None  # spec.speculator.RoundResult for a verification row
    error: RowError | None = None
    prompt_logits: torch.Tensor | None = None  # a flight leader's prompt logits (a copy), to release followers


@dataclass
class RunnerOutput:
    rows: dict[str, RowOutput] = field(default_factory=dict)  # request id -> its row
    drafts: dict[str, DraftOutcome] = field(default_factory=dict)  # request id -> its proposal
    forward_error: str | None = None
    logits_rows: int = 0
    kernel_paths: dict = field(default_factory=dict)  # calls per matmul path in the target forward
