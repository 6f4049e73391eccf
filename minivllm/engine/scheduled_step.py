"""One step's plan, as the scheduler hands it to the model runner: the rows (a prefill
chunk, a decode row, or a speculating decode row with its draft tokens) and the counts
derived from them (prefill tokens, decode rows, the decode rows' context) that the
step's record, the counters and the worker's rates read."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from minivllm.engine.request import Request


@dataclass
class ScheduledRow:
    request: Request
    n_tokens: int
    needs_logits: bool  # the chunk reaches the end of the known tokens
    draft_tokens: int = 0  # a speculative decode row: 1 + draft_tokens tokens, logits at every one
    keep_logits: bool = False  # a flight leader's prompt end: its logits release the followers


@dataclass
class ScheduledStep:
    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)  # when the step began (its scheduling included)

    @property
    def prefill_tokens(self) -> int:
        return sum(r.n_tokens for r in self.rows if r.request.phase == "prefill")

    @property
    def decode_rows(self) -> int:
        return sum(1 for r in self.rows if r.request.phase == "decode")

    @property
    def decode_context_tokens(self) -> int:
        """The K/V tokens the decode rows attend to, summed (the rates' context term)."""
        return sum(r.request.num_computed + r.n_tokens for r in self.rows if r.request.phase == "decode")

    def logits_offsets(self) -> list[tuple[ScheduledRow, int]]:
        """Each row that reads logits, with its first row in the step's logits: a plain row
        reads one, a verification row one per draft token plus one."""
        offsets, li = [], 0
        for row in self.rows:
            if row.needs_logits:
                offsets.append((row, li))
                li += row.draft_tokens + 1
        return offsets
