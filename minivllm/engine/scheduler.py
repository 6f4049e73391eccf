"""Continuous batching: decide which rows the next forward runs.

Step shape (as in vLLM v1):
  1. every running request that is decoding gets one row, oldest first — a decode row
     may need a new page, and if none is free the *newest* running request is
     preempted (its pages are freed, it goes back to the front of the waiting queue
     and is recomputed later);
  2. the rest of the `max_batched_tokens` budget goes to prefill chunks, ordered by the
     policy, over running requests that are still prefilling and waiting requests that
     can be admitted (a free slot under `max_active_requests` and enough free pages
     for their whole prompt).

Pages: the scheduler decides who runs, the KV manager (cache/kv_manager.py) which pages
they get; it never touches a block table itself. Admission asks `KVManager.admit`, which
first restores the longest cached prefix of the request's tokens (all but the last, so
at least one token is computed and there are logits to sample), reserves pages only for
the rest, and starts computing after them. Pages the cache holds idle count as
available: allocating one evicts the least recently used. Single-flight followers stay
in the waiting queue until their flight releases them.

Speculative decoding: after every decode row has its page, decode rows whose request
wants to speculate (`draft_len`) grow to 1 + k tokens, k capped by the step budget and
by the pages free right now — speculation never preempts and never evicts a decode.
Those extra tokens come before prefill chunks, like any running request's work.

Policies:
  fcfs                    arrival order;
  shortest-prefill-first  fewest remaining prompt tokens first (a short request is not
                          stuck behind long prefills);
  round-robin             arrival order rotated by one each step, so concurrent long
                          prefills take turns at the front of the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from minivllm.cache.flight_coordinator import FlightCoordinator
from minivllm.cache.kv_manager import KVManager
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.request import Request, Status


@dataclass
class ScheduledRow:
    request: Request
    n_tokens: int
    needs_logits: bool  # the chunk reaches the end of the known tokens
    draft_tokens: int = 0  # a speculative decode row: 1 + draft_tokens tokens, logits at every one


@dataclass
class ScheduledStep:
    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        return sum(r.n_tokens for r in self.rows if r.request.phase == "prefill")

    @property
    def decode_rows(self) -> int:
        return sum(1 for r in self.rows if r.request.phase == "decode")

    def logits_offsets(self) -> list[tuple[ScheduledRow, int]]:
        """Each row that reads logits, with its first row in the step's logits: a plain row
        reads one, a verification row one per draft token plus one."""
        offsets, li = [], 0
        for row in self.rows:
            if row.needs_logits:
                offsets.append((row, li))
                li += row.draft_tokens + 1
        return offsets


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, flights: FlightCoordinator | None = None, *,
                 draft_len: Callable[[Request], int] | None = None,
                 on_free: Callable[[Request], None] | None = None):
        self.config = config
        # Speculation hooks (the engine's Speculator): the draft tokens a decoding
        # request wants next, and freeing its draft pages with its target pages.
        self.draft_len = draft_len
        self.on_free = on_free
        self.kv = kv
        self.flights = flights
        self.waiting: list[Request] = []  # kept in arrival order; preempted ones keep theirs
        self.running: list[Request] = []  # in admission order
        self._rotation = 0

    # -- queue changes -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.arrival_index)

    def remove(self, request: Request) -> None:
        """Take a request out of every queue and free its pages (finish, abort or error)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._free_pages(request)

    def _free_pages(self, request: Request) -> None:
        self.kv.free(request)
        if self.on_free is not None:
            self.on_free(request)

    def _preempt(self, victim: Request, step: ScheduledStep) -> None:
        self.running.remove(victim)
        self._free_pages(victim)
        victim.num_computed = 0
        victim.status = Status.PREEMPTED
        victim.metrics.preemptions += 1
        self.add(victim)
        step.preempted.append(victim)

    # -- the step ------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_batched_tokens
        scheduled: set[str] = set()

        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running or req.phase != "decode":
                continue
            # The row writes K/V at position num_computed: make sure a page holds it.
            while self.kv.allocate_slots(req, req.num_computed + 1) is None:
                victim = max((r for r in self.running if r.id not in scheduled), key=lambda r: r.arrival_index)
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                continue
            step.rows.append(ScheduledRow(req, 1, True))
            scheduled.add(req.id)
            budget -= 1

        if self.draft_len is not None:
            budget = self._add_draft_tokens(step, budget)

        for req in self._prefill_order():
            if budget == 0:
                break
            if req.status in (Status.WAITING, Status.PREEMPTED):
                # Not re-admitted in the step that preempted it: that would only churn.
                if req in step.preempted or len(self.running) >= self.config.max_active_requests:
                    continue
                if self.flights is not None and self.flights.waiting_on(req.id) is not None:
                    continue
                if not self._admit(req):
                    continue
                self.waiting.remove(req)
                self.running.append(req)
            n = min(req.remaining, budget)
            step.rows.append(ScheduledRow(req, n, req.num_computed + n == req.num_tokens))
            scheduled.add(req.id)
            budget -= n
        return step

    def _add_draft_tokens(self, step: ScheduledStep, budget: int) -> int:
        for row in step.rows:
            if budget == 0:
                break
            req = row.request
            k = min(self.draft_len(req), budget)
            if k <= 0:
                continue
            # Positions num_computed .. num_computed + k need pages; take only free ones.
            k = self.kv.allocate_slots(req, req.num_computed + 1, lookahead=k)
            if k <= 0:
                continue
            row.draft_tokens = k
            row.n_tokens = 1 + k
            budget -= k
        return budget

    def _admit(self, req: Request) -> bool:
        """Give a waiting request pages for every known token, restoring what the prefix
        cache has; False (and nothing changed) if the pool cannot hold the rest now."""
        restored = self.kv.admit(req)
        if restored is None:
            return False
        req.num_computed = req.restored_tokens = restored
        if req.metrics.preemptions == 0:
            req.metrics.cached_prompt_tokens = req.restored_tokens
        req.status = Status.RUNNING
        return True

    def _prefill_order(self) -> list[Request]:
        candidates = [r for r in self.running if r.phase == "prefill"] + list(self.waiting)
        policy = self.config.policy
        if policy == "shortest-prefill-first":
            return sorted(candidates, key=lambda r: (r.remaining, r.arrival_index))
        candidates.sort(key=lambda r: r.arrival_index)
        if policy == "round-robin" and candidates:
            k = self._rotation % len(candidates)
            self._rotation += 1
            return candidates[k:] + candidates[:k]
        return candidates

    # -- inspection ----------------------------------------------------------------------

    def describe(self, req: Request) -> dict:
        flights = self.flights
        return {**req.describe(), "flight": flights.role(req.id) if flights else None,
                "waiting_on": flights.waiting_on(req.id) if flights else None}

    def snapshot(self) -> dict:
        return {
            "policy": self.config.policy,
            "waiting": [self.describe(r) for r in self.waiting if r.status == Status.WAITING],
            "preempted": [self.describe(r) for r in self.waiting if r.status == Status.PREEMPTED],
            "running": [self.describe(r) for r in self.running],
        }
