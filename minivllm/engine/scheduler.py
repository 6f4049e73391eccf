"""Continuous batching: decide which rows the next forward runs.

Step shape (like vLLM v1 and the original engine):
  1. every running request that is decoding gets one row, oldest first — a decode row
     may need a new page, and if none is free the *newest* running request is
     preempted (its pages are freed, it goes back to the front of the waiting queue
     and is recomputed later);
  2. the rest of the `max_batched_tokens` budget goes to prefill chunks, ordered by the
     policy, over running requests that are still prefilling and waiting requests that
     can be admitted (a free slot under `max_active_requests` and enough free pages
     for their whole prompt).

Policies:
  fcfs                    arrival order;
  shortest-prefill-first  fewest remaining prompt tokens first (a short request is not
                          stuck behind long prefills);
  round-robin             arrival order rotated by one each step, so concurrent long
                          prefills take turns at the front of the budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.cache.page_pool import PagePool
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.request import Request, Status


@dataclass
class ScheduledRow:
    request: Request
    n_tokens: int
    needs_logits: bool  # the chunk reaches the end of the known tokens


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


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool):
        self.config = config
        self.pool = pool
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
        if request.block_table:
            self.pool.release(request.block_table)
            request.block_table = []

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
            while self.pool.pages_for(req.num_computed + 1) > len(req.block_table):
                if self.pool.num_free > 0:
                    req.block_table += self.pool.allocate(1, after=req.block_table[-1] if req.block_table else None)
                    continue
                victim = max((r for r in self.running if r.id not in scheduled), key=lambda r: r.arrival_index)
                self._preempt(victim, step)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                continue
            step.rows.append(ScheduledRow(req, 1, True))
            scheduled.add(req.id)
            budget -= 1

        for req in self._prefill_order():
            if budget == 0:
                break
            if req.status in (Status.WAITING, Status.PREEMPTED):
                # Not re-admitted in the step that preempted it: that would only churn.
                if req in step.preempted or len(self.running) >= self.config.max_active_requests:
                    continue
                # Pages for every token already known; a prefix cache will subtract the
                # pages it restores here, so admission counts tokens it supplies.
                needed = self.pool.pages_for(req.num_tokens)
                if needed > self.pool.num_free:
                    continue
                req.block_table = self.pool.allocate(needed)
                req.status = Status.RUNNING
                self.waiting.remove(req)
                self.running.append(req)
            n = min(req.remaining, budget)
            step.rows.append(ScheduledRow(req, n, req.num_computed + n == req.num_tokens))
            scheduled.add(req.id)
            budget -= n
        return step

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

    def snapshot(self) -> dict:
        return {
            "policy": self.config.policy,
            "waiting": [r.describe() for r in self.waiting if r.status == Status.WAITING],
            "preempted": [r.describe() for r in self.waiting if r.status == Status.PREEMPTED],
            "running": [r.describe() for r in self.running],
        }
