"""Continuous batching: decide which rows the next forward runs.

Step shape (as in vLLM v1):
  1. every running request that is decoding gets one row, oldest first — a decode row
     may need a new page, and if none is free the *newest* running request is
     preempted (its pages are freed, it goes back to the front of the waiting queue
     and is recomputed later);
  2. the rest of the `max_batched_tokens` budget goes to prefill chunks, ordered by the
     policy, over running requests that are still prefilling and waiting requests that
     can be admitted (a free slot under `max_active_requests`, or for the prefill half of
     a split request one of the `handoff_rows` beyond, and enough free pages for their
     whole prompt).

Pages: the scheduler decides who runs, the KV manager (cache/kv_manager.py) which pages
they get; it never touches a block table itself. Admission asks `KVManager.admit`, which
first restores the longest cached prefix of the request's tokens (all but the last, so
at least one token is computed and there are logits to sample), reserves pages only for
the rest, and starts computing after them. Pages the cache holds idle count as
available: allocating one evicts the least recently used. Single-flight followers stay
in the waiting queue until their flight releases them.

Speculative decoding: after every decode row has its page, decode rows whose request
wants to speculate (`Speculator.wanted_tokens`) grow to 1 + k tokens, k capped by the
step budget, by the target pages free right now and by the draft pool's — speculation
never preempts and never evicts a decode. Those extra tokens come before prefill
chunks, like any running request's work.

Applying a step (`update`): the scheduler is also the one place requests advance. It
takes the model runner's `RunnerOutput` (engine/runner_output.py) and appends tokens,
applies verified rounds, finishes requests, releases single-flight followers, publishes
pages and feeds the speculation gate its figures. It is the only caller of `KVManager`'s
mutators, on the target's manager and on the draft pool's (spec/drafter.py):
tests/unit/test_kv_writers.py checks that on the source.

Policies:
  fcfs                    arrival order;
  shortest-prefill-first  fewest remaining prompt tokens first (a short request is not
                          stuck behind long prefills);
  round-robin             arrival order rotated by one each step, so concurrent long
                          prefills take turns at the front of the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from minivllm.cache.flight_coordinator import FlightCoordinator
from minivllm.cache.kv_manager import KVManager, Reservation
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.request import Request, Status
from minivllm.engine.runner_output import RowError, RowOutput, RunnerOutput
from minivllm.engine.scheduled_step import ScheduledRow, ScheduledStep
from minivllm.engine.snapshot import describe_step
from minivllm.engine.step_pipeline import can_continue
from minivllm.engine.token_append import append_token, constraint_error
from minivllm.sampling.outputs import TokenEvent

COUNTERS = ("steps", "prefill_tokens", "decode_tokens", "preemptions", "requests_submitted", "requests_finished",
            "finished_stop", "finished_length", "finished_abort", "finished_error", "rejected",
            "steps_queued_ahead",  # decode steps queued before the previous one's tokens were read
            "step_us")  # wall time inside steps (plan to update), summed: busy time beside the wall clock


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, flights: FlightCoordinator | None = None, *,
                 max_model_len: int, eos_ids=(), requests: dict | None = None, speculator=None,
                 draw_alone: Callable[[Request, object], RowOutput] | None = None):
        """`requests`: the engine's request table (followers are found there by id).
        `speculator`: the engine's Speculator when it speculates (its draft pool's
        `KVManager` is driven from here). `draw_alone(request, logits)`: the model
        runner's draw of one token with no forward (a released follower's first)."""
        self.config = config
        self.kv = kv
        self.flights = flights
        self.max_model_len = max_model_len
        self.eos_ids = frozenset(eos_ids)
        self.requests = requests if requests is not None else {}
        self.speculator = speculator
        self.draft_kv = speculator.drafter.kv if speculator is not None else None
        self.draw_alone = draw_alone
        self.logits_hook = None  # LLMEngine.logits_hook: called with each appended token's logits
        self.waiting: list[Request] = []  # kept in arrival order; preempted ones keep theirs
        self.running: list[Request] = []  # in admission order
        self._rotation = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.flight_logits: dict = {}  # leader id -> its prompt's last logits
        self.released_events: list[TokenEvent] = []  # followers' first tokens, owed to the next step's caller
        self.reservations: dict[str, Reservation] = {}  # request id -> pages another worker writes (import_kv)
        # The snapshot schema promises every key, also before the first step.
        self.last_step: dict = describe_step(0, ScheduledStep(), time.perf_counter(), logits_rows=0)

    # -- queue changes -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.arrival_index)

    def import_kv(self, blocks) -> int:
        """Another engine's full pages (cache/kv_transfer.KVBlocks) into the prefix cache,
        for an imported request's admission to restore; returns the tokens newly cached."""
        return self.kv.adopt(blocks)

    def reserve_kv(self, request_id: str, token_ids: list[int]) -> Reservation:
        """Set pages aside for request `request_id`'s K/V of `token_ids`, which another
        worker writes into them directly (a split request's decode half); one at a time
        per request (a second replaces the first)."""
        self.cancel_kv(request_id)
        reservation = self.reservations[request_id] = self.kv.reserve_landing(token_ids)
        return reservation

    def land_kv(self, request_id: str, blocks: int) -> int:
        """The first `blocks` blocks of the reservation are written: into the prefix cache
        with them, for the request's admission to restore; returns the tokens newly cached."""
        return self.kv.land(self.reservations.pop(request_id), blocks)

    def cancel_kv(self, request_id: str) -> bool:
        """Give a reservation back unwritten; False if there is none (idempotent)."""
        reservation = self.reservations.pop(request_id, None)
        if reservation is not None:
            self.kv.drop_landing(reservation)
        return reservation is not None

    def remove(self, request: Request) -> None:
        """Take a request out of every queue and free its pages (finish, abort or error)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        self._free_pages(request)

    def _free_pages(self, request: Request) -> None:
        self.kv.free(request)
        if request.spec is not None and self.draft_kv is not None:
            self.draft_kv.free(request.spec)
            request.spec.computed = 0

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

        if self.speculator is not None:
            budget = self._add_draft_tokens(step, budget)

        free = self._free_rows()
        for req in self._prefill_order():
            if budget == 0:
                break
            if req.status in (Status.WAITING, Status.PREEMPTED):
                # Not re-admitted in the step that preempted it: that would only churn.
                if req in step.preempted or not free[req.handoff]:
                    continue
                if self.flights is not None and self.flights.waiting_on(req.id) is not None:
                    continue
                if not self._admit(req):
                    continue
                self.waiting.remove(req)
                self.running.append(req)
                free = self._free_rows()
            n = min(req.remaining, budget)
            step.rows.append(ScheduledRow(req, n, req.num_computed + n == req.num_tokens))
            scheduled.add(req.id)
            budget -= n
        now = time.perf_counter()
        for row in step.rows:
            req = row.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                req.metrics.queue_time_s = now - req.arrival_time
            row.keep_logits = (row.needs_logits and not req.output_ids and self.flights is not None
                               and self.flights.role(req.id) == "leader")
        return step

    def plan_ahead(self, plan: ScheduledStep) -> ScheduledStep | None:
        """The step after `plan` (launched, not yet applied) when it is the same rows one
        position further: every row can take another token and gets the page for it now.
        None when anything else could happen (a waiting request could take a free slot, a
        row is at its limit, no free page without preempting): then the next step is
        planned as usual, after this one is applied (engine/step_pipeline.py). With every
        slot taken, nobody waiting can be admitted next step anyway: a slot a finishing row
        frees is filled one step later than without the pipeline."""
        free = self._free_rows()
        if any(free[req.handoff] for req in self.waiting):
            return None
        rows = []
        for row in plan.rows:
            req = row.request
            if not can_continue(req, self.max_model_len):
                return None
            # The ahead row writes K/V at num_computed + 1 (num_computed still excludes
            # the row in flight).
            if self.kv.allocate_slots(req, req.num_computed + 2) is None:
                return None
            rows.append(ScheduledRow(req, 1, True))
        return ScheduledStep(rows)

    def _add_draft_tokens(self, step: ScheduledStep, budget: int) -> int:
        for row in step.rows:
            if budget == 0:
                break
            req = row.request
            k = min(self.speculator.wanted_tokens(req, self.max_model_len), budget)
            if k <= 0:
                continue
            # Positions num_computed .. num_computed + k need pages; take only free ones.
            k = self.kv.allocate_slots(req, req.num_computed + 1, lookahead=k)
            if k <= 0:
                continue
            budget -= k
            # The draft writes positions 0..n+k-2: shrink k until the draft pool holds them
            # (a full draft pool: the row decodes without a proposal).
            n = req.num_tokens
            while k > 0 and self.draft_kv.allocate_slots(req.spec, n + k - 1) is None:
                k -= 1
            if k > 0:
                row.draft_tokens = k
                row.n_tokens = 1 + k
        return budget

    def _free_rows(self) -> tuple[bool, bool]:
        """(a row for a request that stays, a row for a handoff), indexed by `req.handoff`:
        requests that stay hold at most `max_active_requests` rows; the prefill halves of
        split requests, which leave after their first token, may also take the
        `handoff_rows` beyond. Computed once per pass (and again after an admission), not
        per waiting request."""
        if len(self.running) >= self.config.max_rows:
            return False, False
        staying = len(self.running) if not self.config.handoff_rows else sum(not r.handoff for r in self.running)
        return staying < self.config.max_active_requests, True

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

    # -- applying a step -------------------------------------------------------------------

    def update(self, plan: ScheduledStep, output: RunnerOutput | None) -> list[TokenEvent]:
        """Apply the runner's output for `plan` (None when nothing ran); the step's token
        events, then those of followers released since the last step. The order below is
        load-bearing: K/V first counts as computed (and is published) for every plain row,
        then each row's tokens are appended in row order; a speculating row's plain step
        is counted before its token (which may finish it and move its figures to the
        totals)."""
        counters, t0 = self.counters, plan.started
        counters["preemptions"] += len(plan.preempted)
        if not plan.rows:
            self.last_step = describe_step(counters["steps"], plan, t0, logits_rows=0)
            return self._with_released([])
        counters["steps"] += 1
        self._apply_drafts(plan, output.drafts)
        counters["prefill_tokens"] += plan.prefill_tokens
        counters["decode_tokens"] += plan.decode_rows
        described = describe_step(counters["steps"], plan, t0, logits_rows=output.logits_rows)
        counters["step_us"] += round(described["duration_s"] * 1e6)
        self.last_step = described
        if output.forward_error is not None:
            return self._with_released([self.finish(row.request, "error", token=-1, text="", error=output.forward_error)
                                        for row in plan.rows])
        described["kernel_paths"] = output.kernel_paths
        for row in plan.rows:
            if not row.draft_tokens:  # verification rows advance by what they accept, below
                row.request.num_computed += row.n_tokens
                self.kv.computed(row.request)
        events: list[TokenEvent] = []
        timed = []  # (request, round result or None) for the speculation pay-off gate
        for row in plan.rows:
            if not row.needs_logits:
                continue
            req, result = row.request, output.rows[row.request.id]
            if row.draft_tokens:
                events += self._apply_round(req, result)
                if result.round is not None:
                    timed.append((req, result.round))
                continue
            first = not req.output_ids
            if result.prompt_logits is not None:
                self.flight_logits[req.id] = result.prompt_logits
            if not first and req.spec is not None:
                self.speculator.record_plain(req)
                timed.append((req, None))
            event = self._take_token(req, result)
            events.append(event)
            if (first and not event.finished and req.id in self.flight_logits
                    and self.flights.release == "after_prefill"):
                # The prompt is computed: publish its pages (whatever the publication
                # policy) and end the flight, releasing the followers.
                self.kv.publish(req)
                self._release_followers(req.id, self.flights.prefill_done(req.id))
        described["duration_s"] = time.perf_counter() - t0
        if timed:
            self.speculator.record_step_time(timed, described["duration_s"], measured=plan.prefill_tokens == 0)
        return self._with_released(events)

    def _with_released(self, events: list[TokenEvent]) -> list[TokenEvent]:
        events += self.released_events  # followers released in this step or by an abort since the last
        self.released_events = []
        return events

    def _apply_drafts(self, plan: ScheduledStep, drafts: dict) -> None:
        """Record what the draft computed; a row whose proposal came back shorter (a stop
        token, a failed draft) shrinks to match, down to a plain decode row."""
        for row in plan.rows:
            if not row.draft_tokens:
                continue
            state, outcome = row.request.spec, drafts[row.request.id]
            if outcome.failed:  # its K/V may be half-written: recompute it later
                self.draft_kv.free(state)
                state.computed = 0
            else:
                state.computed, state.catch_up = outcome.computed, outcome.catch_up
            row.draft_tokens, row.n_tokens = len(outcome.tokens), 1 + len(outcome.tokens)

    def _apply_round(self, req: Request, result: RowOutput) -> list[TokenEvent]:
        """Append a verified round's tokens, and cut both caches back to the accepted positions."""
        if result.error is not None:
            return [self._failed(req, result.error)]
        n0 = req.num_computed  # the last committed token's position: its K/V was just written
        round_ = result.round
        self.speculator.record_round(req, round_, self.counters["steps"])
        events = []
        for j, token in enumerate(result.tokens):
            # K/V now valid: the last committed token and the j proposals accepted so far.
            req.num_computed = n0 + 1 + j
            if self.logits_hook is not None:
                self.logits_hook(req.id, result.logits[j])
            event = self._append(req, token, result.logprobs[j])
            events.append(event)
            if event.finished:
                break
        if req.status != Status.FINISHED:
            self.kv.truncate(req, req.num_tokens)  # the rejected positions' pages
            # The draft computed positions up to the proposal's next-to-last token.
            state = req.spec
            state.computed = min(state.computed, n0 + 1 + min(round_.accepted, round_.proposed - 1))
            self.draft_kv.truncate(state, state.computed)
            self.kv.computed(req)
        return events

    def _take_token(self, req: Request, result: RowOutput) -> TokenEvent:
        if result.error is not None:
            return self._failed(req, result.error)
        if self.logits_hook is not None:
            self.logits_hook(req.id, result.logits[0])
        return self._append(req, result.tokens[0], result.logprobs[0])

    def _append(self, req: Request, token: int, logprobs: dict | None) -> TokenEvent:
        appended = append_token(req, token, self.eos_ids, self.max_model_len)
        if appended.reason is None:
            req.text += appended.text
            return TokenEvent(req.id, token, appended.text, logprobs=logprobs)
        return self.finish(req, appended.reason, appended.token, appended.text,
                           logprobs=None if appended.error else logprobs, error=appended.error)

    def _failed(self, req: Request, error: RowError) -> TokenEvent:
        if error.kind == "constraint":
            return self.finish(req, "error", token=-1, text=req.stops.flush(),
                               error=constraint_error(req, error.message))
        return self.finish(req, "error", token=-1, text="", error=error.message)

    def _release_followers(self, leader_id: str, followers: list[str]) -> None:
        """Followers of a flight whose prompt is computed and published take their first
        token from the leader's prompt logits now, so their TTFT is the leader's, not one
        step later; they then wait for admission like a preempted request (one output
        token, no pages) and restore the prompt's pages from the prefix cache."""
        logits = self.flight_logits.pop(leader_id, None)
        if logits is None:
            return
        for fid in followers:
            req = self.requests[fid]
            self.released_events.append(self._take_token(req, self.draw_alone(req, logits)))

    def finish(self, req: Request, reason: str, token: int, text: str, *, logprobs: dict | None = None,
               error: str | None = None) -> TokenEvent:
        """End `req` (stop, length, abort or error): free its pages, end its flight."""
        req.text += text
        req.finish_reason = reason
        req.error = error
        req.status = Status.FINISHED
        req.metrics.e2e_s = req.since_arrival()
        # A failed request may hold K/V that a failed forward half-wrote: it publishes
        # nothing more. Finished and aborted ones publish every full page they computed
        # (abort runs between steps, so those pages are complete).
        published = reason != "error" and self.kv.caching
        if published:
            self.kv.publish(req)
        self.remove(req)
        if self.speculator is not None:
            self.speculator.finished(req)
        if self.flights is not None:
            prompt_ready = published and req.id in self.flight_logits
            released = self.flights.terminated(req.id, prompt_ready=prompt_ready)
            if prompt_ready:
                self._release_followers(req.id, released)
            self.flight_logits.pop(req.id, None)
        self.counters["requests_finished"] += 1
        self.counters[f"finished_{reason}"] += 1
        return TokenEvent(req.id, token, text, finished=True, finish_reason=reason, logprobs=logprobs, error=error)

    def clear_prefix_cache(self) -> int:
        """Evict every idle cached page (pages in use stay cached); returns how many."""
        return self.kv.clear_cache()

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
