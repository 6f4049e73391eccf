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

Prefix cache: admission first looks the request's tokens (all but the last, so at least
one token is computed and there are logits to sample) up in the prefix index, shares the
matched pages, reserves pages only for the rest, and starts computing after them. Pages
the cache holds idle count as available: allocating one evicts the least recently used.
Single-flight followers stay in the waiting queue until their flight releases them.

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
from minivllm.cache.page_pool import PagePool
from minivllm.cache.prefix_index import PrefixIndex
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


class Scheduler:
    def __init__(self, config: EngineConfig, pool: PagePool, prefix: PrefixIndex | None = None,
                 flights: FlightCoordinator | None = None, *,
                 draft_len: Callable[[Request], int] | None = None,
                 on_free: Callable[[Request], None] | None = None):
        self.config = config
        # Speculation hooks (the engine's Speculator): the draft tokens a decoding
        # request wants next, and freeing its draft pages with its target pages.
        self.draft_len = draft_len
        self.on_free = on_free
        self.pool = pool
        self.prefix = prefix
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
        if request.block_table:
            self.pool.release(request.block_table[::-1])  # deepest first: the prefix cache's LRU order
            request.block_table = []
        request.published_pages = 0
        if self.on_free is not None:
            self.on_free(request)

    def truncate(self, request: Request) -> None:
        """Free the pages past the request's known tokens (rejected speculative positions)."""
        keep = self.pool.pages_for(request.num_tokens)
        if len(request.block_table) > keep:
            self.pool.release(request.block_table[keep:][::-1])
            del request.block_table[keep:]

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
                if self.pool.num_available > 0:
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
            ps = self.pool.page_size
            # Positions num_computed .. num_computed + k need pages; take only free ones.
            spare = (len(req.block_table) + self.pool.num_available) * ps - (req.num_computed + 1)
            k = min(k, spare)
            if k <= 0:
                continue
            need = self.pool.pages_for(req.num_computed + 1 + k) - len(req.block_table)
            if need > 0:
                req.block_table += self.pool.allocate(need, after=req.block_table[-1])
            row.draft_tokens = k
            row.n_tokens = 1 + k
            budget -= k
        return budget

    def _admit(self, req: Request) -> bool:
        """Give a waiting request pages for every known token, restoring what the prefix
        cache has; False (and nothing changed) if the pool cannot hold the rest now."""
        hit = []
        if self.prefix is not None:
            lookup_ids = req.all_ids[:-1]
            hit = self.prefix.match(lookup_ids, self.prefix.keys_for(lookup_ids, req.cache_keys))
        needed = self.pool.pages_for(req.num_tokens) - len(hit)
        # Matched idle pages stop being evictable once shared, so they don't count twice.
        available = self.pool.num_available - (self.prefix.num_idle_among(hit) if hit else 0)
        if needed > available:
            return False
        shared = self.prefix.acquire(hit) if self.prefix is not None else []
        req.block_table = shared + self.pool.allocate(needed, after=shared[-1] if shared else None)
        req.num_computed = req.restored_tokens = len(hit) * self.pool.page_size
        req.published_pages = len(hit)
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
