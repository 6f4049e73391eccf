"""`LLMEngine`: one device's scheduler, KV page pool and model, advanced one step at a time.

    engine = LLMEngine(model, tokenizer, EngineConfig(...))   # draft_model=... to speculate
    rid = engine.add_request(prompt_ids, SamplingParams(...))
    for events in engine.run(): ...                           # or engine.step() by hand
    output = engine.pop_output(rid)

Single-threaded by design. `run()` is the one step loop (`LLM`, the serving worker and
debug.compare use it); a host taking submissions from elsewhere applies them in its
`between_steps` hook. Callers get `add_request`, `abort`, `release`, `step`/`run`,
`output`/`pop_output`, `snapshot`, `clear_prefix_cache`, `reset_stats` and read-only views (`request_state`,
`request_ids`, `progress`, `cached_prefix_tokens`, `kv_ownership`); the request table,
the scheduler and the KV manager (which owns the prefix index) are private.

Robustness contract: invalid requests are refused in `add_request` with a `ConfigError`
naming the field; a failure inside a step finishes only the affected requests with
finish_reason "error" and frees their pages; nothing a request does can leak a page.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import torch

from minivllm.cache.batch_kv import PagedBatchKV, Segment
from minivllm.cache.flight_coordinator import FlightCoordinator
from minivllm.cache.kv_manager import KVManager
from minivllm.cache.page_pool import PagePool
from minivllm.cache.prefix_index import PrefixIndex
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.request import Request, RequestView, Status
from minivllm.engine.request_checks import check_request
from minivllm.engine.scheduler import ScheduledStep, Scheduler
from minivllm.engine.cuda_graphs import graph_runner_for
from minivllm.engine.snapshot import build_snapshot, describe_step
from minivllm.errors import ConfigError
from minivllm.model.decoder import DecoderModel
from minivllm.obs.trace import trace_scope
from minivllm.sampling.constraint import Constraints, Unsatisfiable
from minivllm.sampling.outputs import RequestOutput, TokenEvent
from minivllm.sampling.sampler import top_logprobs
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.sampling.step_draw import draw_step


class LLMEngine:
    def __init__(self, model: DecoderModel, tokenizer, config: EngineConfig | None = None, *,
                 draft_model: DecoderModel | None = None, draft_tokenizer=None, draft_name: str = "draft"):
        """`draft_model` (with its `draft_tokenizer`, which must equal the target's) turns
        on speculative decoding; see spec/speculator.py."""
        self.model = model
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        cfg = model.config
        limit = cfg.context_length
        if draft_model is not None:
            limit = min(limit, draft_model.config.context_length)  # both models see every position
        if config.max_model_len is not None and not 1 < config.max_model_len <= limit:
            raise ConfigError("max_model_len", config.max_model_len, f"must be in [2, {limit}] (the model's context length)")
        # A modest default keeps the KV pool small on CPUs and T4s.
        self.max_model_len = config.max_model_len or min(limit, 4096)
        page_size = self.max_model_len if config.kv_mode == "contiguous" else config.page_size
        page_bytes = PagePool.page_bytes(n_layers=cfg.n_layers, page_size=page_size, n_kv_heads=cfg.n_kv_heads,
                                         head_dim=cfg.head_dim, dtype=model.dtype)
        num_pages = config.kv_budget_bytes(model.device, self.max_model_len, page_bytes, page_size) // page_bytes
        self.pool = PagePool(n_layers=cfg.n_layers, num_pages=num_pages, page_size=page_size,
                             n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=model.dtype, device=model.device)
        # The only writer of block tables, and the owner of the prefix index.
        prefix = PrefixIndex(self.pool) if config.prefix_cache_enabled else None
        self._kv = KVManager(self.pool, prefix, publication=config.publication)
        self.flights = FlightCoordinator(config.single_flight) if config.single_flight != "off" else None
        self.speculator = None
        if draft_model is not None:
            from minivllm.engine.cuda_graphs import decode_graph_runner
            from minivllm.spec.speculator import Speculator

            self.speculator = Speculator(draft_model, draft_tokenizer if draft_tokenizer is not None else tokenizer,
                                         model, tokenizer, config, kv_tokens=num_pages * page_size,
                                         page_size=page_size, max_model_len=self.max_model_len, draft_name=draft_name,
                                         graph_runner=None if config.enforce_eager else decode_graph_runner)
        spec = self.speculator
        self._scheduler = Scheduler(
            config, self._kv, self.flights,
            draft_len=(lambda r: spec.wanted_tokens(r, self.max_model_len)) if spec is not None else None,
            on_free=spec.release if spec is not None else None)
        self._flight_logits: dict[str, torch.Tensor] = {}  # leader id -> its prompt's last logits
        self._released_events: list[TokenEvent] = []  # followers' first tokens, returned by step()
        self.constraints = Constraints(tokenizer, cfg.vocab_size)  # masks for params.structured
        # This engine's kernel choices, applied to the (possibly shared) model before
        # every forward: two engines over one model (LLM.fork) can differ in them.
        self.kernel_options = config.kernel_options().resolved(model.device, dense_bytes=model.dense_bytes())
        # Called as logits_hook(request_id, logits) with each sampled row's float32 logits
        # right before sampling (debug.compare records top-k logits through it).
        self.logits_hook = None
        self.graph_runner = None if config.enforce_eager else graph_runner_for(model, self.pool, config, self.max_model_len,
                                                                               self.kernel_options.batch_invariant)
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.counters = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "preemptions": 0,
                         "requests_submitted": 0, "requests_finished": 0, "finished_stop": 0,
                         "finished_length": 0, "finished_abort": 0, "finished_error": 0, "rejected": 0}
        # The snapshot schema promises every key, also before the first step.
        self.last_step: dict = describe_step(self.counters["steps"], ScheduledStep(), time.perf_counter(), logits_rows=0)

    # -- submission ----------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
                    prompt: str | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        try:
            check_request(prompt_ids, params, request_id=request_id, taken=request_id in self._requests,
                          vocab=self.model.config.vocab_size, max_model_len=self.max_model_len, pool=self.pool,
                          scratch_page=self.graph_runner is not None)
            constraint = self.constraints.make(params.structured)
        except ConfigError:
            self.counters["rejected"] += 1
            raise
        index = next(self._arrivals)
        rid = request_id or f"req-{index}"
        req = Request(rid, prompt, prompt_ids, params, self.tokenizer, self.model.device, index)
        req.constraint = constraint
        self._requests[rid] = req
        if self.flights is not None:
            self.flights.join(rid, req.prompt_ids)
        if self.speculator is not None:
            self.speculator.attach(req)
        self._scheduler.add(req)
        self.counters["requests_submitted"] += 1
        return rid

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request at any moment; its pages are freed at once."""
        req = self._requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        return self._finish(req, "abort", token=-1, text=req.stops.flush())

    def release(self, request_id: str) -> None:
        """Done with this request: abort it if unfinished and forget it (a no-op if unknown)."""
        self.abort(request_id)
        self._requests.pop(request_id, None)

    # -- the step ------------------------------------------------------------------------

    def run(self, between_steps: Callable[[bool], bool] | None = None, *, until: Callable[[], bool] | None = None,
            on_error: Callable[[Exception], list[TokenEvent]] | None = None) -> Iterator[list[TokenEvent]]:
        """The step loop: yields each step's token events. Every turn first calls
        `between_steps(busy)` if given (busy: something is unfinished), where the host applies
        submissions and aborts, may wait for work, and returns False to end the loop. It also
        ends once `until()` is true, or when nothing is unfinished and there is no
        `between_steps`. `on_error(exc)` turns a step that raised into events instead."""
        while True:
            if between_steps is not None and not between_steps(self.has_unfinished()):
                return
            if until is not None and until():
                return
            if self.has_unfinished():
                try:
                    events = self.step()
                except Exception as exc:  # noqa: BLE001 - only with on_error; re-raised otherwise
                    if on_error is None:
                        raise
                    events = on_error(exc)
                yield events
            elif between_steps is None:
                return

    def has_unfinished(self) -> bool:
        # Released followers' first-token events (from an abort between steps) are still
        # owed to their consumers even if those followers already finished on that token.
        return bool(self._scheduler.waiting or self._scheduler.running or self._released_events)

    def step(self) -> list[TokenEvent]:
        """Schedule, run one forward over every scheduled row, sample; return token events."""
        with trace_scope("step", self.counters["steps"]):
            events = self._step()
        events += self._released_events  # followers released in this step or by an abort since the last
        self._released_events = []
        return events

    @torch.inference_mode()
    def _step(self) -> list[TokenEvent]:
        t0 = time.perf_counter()
        plan = self._scheduler.schedule()
        self.counters["preemptions"] += len(plan.preempted)
        events: list[TokenEvent] = []
        if not plan.rows:
            self.last_step = describe_step(self.counters["steps"], plan, t0, logits_rows=0)
            return events
        self.counters["steps"] += 1
        proposals = self._draft(plan)
        ids, positions, segments, logit_rows = [], [], [], []
        for row in plan.rows:
            req = row.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.perf_counter()
                req.metrics.queue_time_s = req.first_scheduled_time - req.arrival_time
            start = req.num_computed
            if row.draft_tokens:
                # Verification row: the last committed token and the proposal, scored at
                # every position (k rows check the proposal, the last one gives the bonus).
                chunk = req.all_ids[start:start + 1] + proposals[req.id].tokens
                logit_rows += range(len(ids), len(ids) + len(chunk))
            else:
                chunk = req.all_ids[start:start + row.n_tokens]
                if row.needs_logits:
                    logit_rows.append(len(ids) + len(chunk) - 1)
            ids += chunk
            positions += range(start, start + len(chunk))
            segments.append(Segment(list(req.block_table), start, len(chunk)))
        self.counters["prefill_tokens"] += plan.prefill_tokens
        self.counters["decode_tokens"] += plan.decode_rows
        described = describe_step(self.counters["steps"], plan, t0, logits_rows=len(logit_rows))
        device = self.model.device
        model = self.model
        model.set_kernel_options(self.kernel_options)
        model.kernel_options.path_counts.clear()
        offsets = plan.logits_offsets()
        plain = [(row.request, li) for row, li in offsets if not row.draft_tokens]
        try:
            with trace_scope("model", "mixed" if plan.decode_rows and plan.prefill_tokens else
                             "decode" if plan.decode_rows else "prefill"):
                runner = self.graph_runner
                logits = None
                if runner is not None and len(logit_rows) == len(segments) and runner.can_run(segments):
                    logits = runner.run(ids, segments)
                if logits is None:
                    kv = PagedBatchKV(self.pool, segments, invariant=self.kernel_options.batch_invariant)
                    logits = model.forward_batch(
                        torch.tensor(ids, device=device), torch.tensor(positions, device=device),
                        kv, torch.tensor(logit_rows, dtype=torch.long, device=device))
        except Exception as exc:  # noqa: BLE001 — a failed forward fails its requests, not the engine
            for row in plan.rows:
                events.append(self._finish(row.request, "error", token=-1, text="", error=f"forward failed: {exc}"))
            self.last_step = described
            return events

        described["kernel_paths"] = dict(model.kernel_options.path_counts)
        # Constrained rows' masks, computed while a GPU still runs the forward just queued.
        masks = self.constraints.early_masks(plain, masked_logits_wanted=self.logits_hook is not None,
                                             device_busy=logits.is_cuda)
        rows = logits.unbind(0)  # every row's view at once: cheaper than indexing each
        drawn = self._draw([(req, rows[li]) for req, li in plain], masks)
        for row in plan.rows:
            if row.draft_tokens:
                continue  # advanced by the verification below, by what it accepts
            row.request.num_computed += row.n_tokens
            self._kv.computed(row.request)
        timed = []  # (request, round result or None) for the speculation pay-off gate
        for row, li in offsets:
            req = row.request
            if row.draft_tokens:
                result, round_events = self._verify_round(req, logits[li:li + row.draft_tokens + 1], proposals[req.id])
                events += round_events
                if result is not None:
                    timed.append((req, result))
                continue
            row_logits = logits[li]
            first = not req.output_ids
            if first and self.flights is not None and self.flights.role(req.id) == "leader":
                # Every follower's first token comes from these same prompt logits (its
                # own sampling settings and generator), at release: keep a copy.
                self._flight_logits[req.id] = row_logits.clone()
            if not first and req.spec is not None:
                # Counted before the token is appended: it may finish the request, whose
                # stats then move into the engine's totals.
                self.speculator.record_plain(req)
                timed.append((req, None))
            event = self._sample_token(req, row_logits, drawn[req.id])
            events.append(event)
            if (first and not event.finished and req.id in self._flight_logits
                    and self.flights.release == "after_prefill"):
                # The prompt is computed: publish its pages (whatever the publication
                # policy) and end the flight, releasing the followers.
                self._kv.publish(req)
                self._release_followers(req.id, self.flights.prefill_done(req.id))
        if timed and logits.is_cuda:
            torch.cuda.synchronize(logits.device)  # the gate weighs device time; forced tokens need not wait
        described["duration_s"] = time.perf_counter() - t0
        if timed:
            self.speculator.record_step_time(timed, described["duration_s"], measured=plan.prefill_tokens == 0)
        self.last_step = described
        return events

    # -- speculation ---------------------------------------------------------------------

    def _draft(self, plan: ScheduledStep) -> dict:
        """Run the draft for every speculative row; rows whose proposal came back shorter
        (a stop token, a full draft pool) shrink to match, down to a plain decode row."""
        jobs = [(row.request, row.draft_tokens) for row in plan.rows if row.draft_tokens]
        if not jobs:
            return {}
        with trace_scope("draft", len(jobs)):
            proposals = self.speculator.propose(jobs)
        for row in plan.rows:
            if row.draft_tokens:
                m = len(proposals[row.request.id].tokens)
                row.draft_tokens, row.n_tokens = m, 1 + m
        return proposals

    def _verify_round(self, req: Request, logits: torch.Tensor, proposal) -> tuple[object, list[TokenEvent]]:
        """Accept/correct the proposal, append its tokens, and cut both caches back to the
        accepted positions."""
        spec = self.speculator
        n0 = req.num_computed  # the last committed token's position: its K/V was just written
        try:
            with trace_scope("verify", req.id):
                if req.constraint is not None:
                    logits = self.constraints.mask_along(req.constraint, logits, proposal.tokens)
                result = spec.verify(req, logits, proposal)
        except Unsatisfiable as exc:
            return None, [self._constraint_failed(req, exc)]
        except Exception as exc:  # noqa: BLE001
            return None, [self._finish(req, "error", token=-1, text="", error=f"verification failed: {exc}")]
        spec.record_round(req, result, self.counters["steps"])
        events = []
        for j, (token, r) in enumerate(zip(result.tokens, result.logit_rows)):
            # K/V now valid: the last committed token and the j proposals accepted so far.
            req.num_computed = n0 + 1 + j
            if self.logits_hook is not None:
                self.logits_hook(req.id, logits[r])
            logprobs = top_logprobs(logits[r], token, req.params.logprobs) if req.params.logprobs is not None else None
            event = self._append_token(req, token, logprobs)
            events.append(event)
            if event.finished:
                break
        if req.status != Status.FINISHED:
            self._kv.truncate(req, req.num_tokens)  # the rejected positions' pages
            # The draft computed positions up to the proposal's next-to-last token.
            spec.drafter.truncate(req.spec, n0 + 1 + min(result.accepted, result.proposed - 1))
            self._kv.computed(req)
        return result, events

    def _draw(self, rows: list[tuple[Request, torch.Tensor]], masks: dict) -> dict:
        """The rows' tokens, drawn together (step_draw.py). If that fails, each row draws
        alone, so the failure ends only the requests it belongs to."""
        try:
            with trace_scope("sample", len(rows)):
                return draw_step(rows, masks, self.constraints, want_masked=self.logits_hook is not None)
        except Exception as exc:  # noqa: BLE001
            if len(rows) == 1:
                return {rows[0][0].id: exc}
            return {k: v for row in rows for k, v in self._draw([row], masks).items()}

    def _sample_token(self, req: Request, row_logits: torch.Tensor, drawn=None) -> TokenEvent:
        """`drawn`: the row's Drawn token from the step's draw, or why it has none; None
        draws it here (a follower's first token from its leader's logits)."""
        try:
            if drawn is None:
                drawn = self._draw([(req, row_logits)], {})[req.id]
            if isinstance(drawn, Exception):
                raise drawn
            token = drawn.token
            if self.logits_hook is not None:
                self.logits_hook(req.id, drawn.logits)
            logprobs = top_logprobs(drawn.logits, token, req.params.logprobs) if req.params.logprobs is not None else None
        except Unsatisfiable as exc:
            return self._constraint_failed(req, exc)
        except Exception as exc:  # noqa: BLE001
            return self._finish(req, "error", token=-1, text="", error=f"sampling failed: {exc}")
        return self._append_token(req, token, logprobs)

    def _constraint_failed(self, req: Request, exc: Exception) -> TokenEvent:
        return self._finish(req, "error", token=-1, text=req.stops.flush(),
                            error=f"the structured output ({req.params.structured.kind}) cannot be completed: {exc}")

    def _release_followers(self, leader_id: str, followers: list[str]) -> None:
        """Followers of a flight whose prompt is computed and published sample their first
        token from the leader's prompt logits now, so their TTFT is the leader's, not one
        step later; they then wait for admission like a preempted request (one output
        token, no pages) and restore the prompt's pages from the prefix cache."""
        logits = self._flight_logits.pop(leader_id, None)
        if logits is None:
            return
        for fid in followers:
            self._released_events.append(self._sample_token(self._requests[fid], logits))

    def _append_token(self, req: Request, token: int, logprobs: dict | None) -> TokenEvent:
        if not req.output_ids:
            req.metrics.time_to_first_token_s = req.since_arrival()
        req.output_ids.append(token)
        req.metrics.output_tokens = len(req.output_ids)
        req.metrics.e2e_s = req.since_arrival()
        params = req.params
        if req.constraint is not None:
            try:
                req.constraint.advance(token)
            except Unsatisfiable as exc:
                return self._constraint_failed(req, exc)
        eos = (not params.ignore_eos) and token in self.tokenizer.eos_ids
        if eos or token in params.stop_token_ids:
            # The stop token's own text is not part of the output.
            text, _ = req.stops.feed(req.detok.flush())
            return self._finish(req, "stop", token, text + req.stops.flush(), logprobs=logprobs)
        text, hit = req.stops.feed(req.detok.push(token))
        if hit:
            return self._finish(req, "stop", token, text, logprobs=logprobs)
        complete = req.constraint is not None and req.constraint.stopped  # the grammar admits nothing more
        if complete or len(req.output_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            more, _ = req.stops.feed(req.detok.flush())
            return self._finish(req, "stop" if complete else "length", token, text + more + req.stops.flush(),
                                logprobs=logprobs)
        req.text += text
        return TokenEvent(req.id, token, text, logprobs=logprobs)

    def _finish(self, req: Request, reason: str, token: int, text: str, *, logprobs: dict | None = None,
                error: str | None = None) -> TokenEvent:
        req.text += text
        req.finish_reason = reason
        req.error = error
        req.status = Status.FINISHED
        req.metrics.e2e_s = req.since_arrival()
        # A failed request may hold K/V that a failed forward half-wrote: it publishes
        # nothing more. Finished and aborted ones publish every full page they computed
        # (abort runs between steps, so those pages are complete).
        published = reason != "error" and self._kv.caching
        if published:
            self._kv.publish(req)
        self._scheduler.remove(req)
        if self.speculator is not None:
            self.speculator.finished(req)
        if self.flights is not None:
            prompt_ready = published and req.id in self._flight_logits
            released = self.flights.terminated(req.id, prompt_ready=prompt_ready)
            if prompt_ready:
                self._release_followers(req.id, released)
            self._flight_logits.pop(req.id, None)
        self.counters["requests_finished"] += 1
        self.counters[f"finished_{reason}"] += 1
        return TokenEvent(req.id, token, text, finished=True, finish_reason=reason, logprobs=logprobs, error=error)

    # -- results and inspection ---------------------------------------------------------------

    def output(self, request_id: str) -> RequestOutput:
        req = self._requests[request_id]
        req.metrics.speculation = req.spec.stats.as_dict() if req.spec is not None else None
        return RequestOutput(req.id, req.prompt, list(req.prompt_ids), list(req.output_ids), req.text,
                             req.finish_reason, req.metrics, req.error)

    def pop_output(self, request_id: str) -> RequestOutput:
        out = self.output(request_id)
        if self._requests[request_id].status == Status.FINISHED:
            del self._requests[request_id]
        return out

    def request_ids(self) -> list[str]:
        """Every request the engine still holds (finished ones until popped), in submission order."""
        return list(self._requests)

    def request_state(self, request_id: str) -> RequestView:
        """A read-only live view of one request (KeyError for an unknown id)."""
        return RequestView(self._requests[request_id])

    def progress(self) -> dict[str, int]:
        """Running requests (holding pages) in admission order: prompt tokens computed."""
        return {r.id: min(r.num_computed, len(r.prompt_ids)) for r in self._scheduler.running}

    def cached_prefix_tokens(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of this prompt the prefix cache could restore now; safe
        to call from another thread (a read-only lookup, possibly slightly stale)."""
        return self._kv.cached_prefix_tokens(prompt_ids)

    def kv_ownership(self) -> dict:
        """Who holds which KV page, copied: unfinished requests' target and draft pages, the
        prefix index's contents (`KVManager.cache_contents`), the graphs' scratch page."""
        live = [r for r in self._requests.values() if r.status != Status.FINISHED]
        return {"requests": {r.id: list(r.block_table) for r in live},
                "draft": {r.id: list(r.spec.block_table) for r in live if r.spec is not None},
                "cache": self._kv.cache_contents(),
                "reserved": [self.graph_runner.scratch_page] if self.graph_runner is not None else []}

    def clear_prefix_cache(self) -> int:
        """Evict every idle cached page (pages in use stay cached); returns how many."""
        return self._kv.clear_cache()

    def reset_stats(self) -> None:
        """Forget warm-up or calibration traffic: `clear_prefix_cache`, then zero the cache's
        counters, the engine's and the structured draws'."""
        self.clear_prefix_cache()
        self._kv.reset_counters()
        for counts in (self.counters, self.constraints.counts):
            for key in counts:
                counts[key] = 0

    @property
    def cuda_graphs_enabled(self) -> bool:
        return self.graph_runner is not None

    def snapshot(self) -> dict:
        return build_snapshot(self, self._scheduler, self._kv, self._requests)
