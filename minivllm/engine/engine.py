"""`LLMEngine`: one device's scheduler, KV page pool and model, advanced one step at a time.

    engine = LLMEngine(model, tokenizer, EngineConfig(...))   # draft_model=... to speculate
    rid = engine.add_request(prompt_ids, SamplingParams(...))
    for events in engine.run(): ...                           # or engine.step() by hand
    output = engine.pop_output(rid)

A step is three calls: `Scheduler.schedule` plans it, `ModelRunner.execute` runs it
(the only code that runs a model) and returns plain data, `Scheduler.update` applies it
(the only place requests advance and KV tables change). Submission, abort and outputs
stay here.

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

from minivllm.cache.flight_coordinator import FlightCoordinator
from minivllm.cache.kv_manager import KVManager
from minivllm.cache.kv_transfer import LandedBlocks
from minivllm.cache.page_pool import PagePool
from minivllm.cache.prefix_index import PrefixIndex
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.handoff import Handoff, continuation, export_request, restore_generator
from minivllm.engine.model_runner import ModelRunner
from minivllm.engine.request import Request, RequestView, Status
from minivllm.engine.request_checks import check_request
from minivllm.engine.scheduler import Scheduler
from minivllm.engine.snapshot import build_snapshot
from minivllm.engine.step_pipeline import steady_decode, still_valid
from minivllm.errors import ConfigError
from minivllm.model.decoder import DecoderModel
from minivllm.obs.trace import trace_scope
from minivllm.sampling.constraint import Constraints
from minivllm.sampling.outputs import RequestOutput, TokenEvent
from minivllm.sampling.sampling_params import SamplingParams


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
            raise ConfigError(
                "max_model_len", config.max_model_len, f"must be in [2, {limit}] (the model's context length)"
            )
        # A modest default keeps the KV pool small on CPUs and T4s.
        self.max_model_len = config.max_model_len or min(limit, 4096)
        page_size = self.max_model_len if config.kv_mode == "contiguous" else config.page_size
        page_bytes = PagePool.page_bytes(n_layers=cfg.n_layers, page_size=page_size, n_kv_heads=cfg.n_kv_heads,
                                         head_dim=cfg.head_dim, dtype=model.dtype)
        num_pages = config.kv_budget_bytes(model.device, self.max_model_len, page_bytes, page_size) // page_bytes
        self.pool = PagePool(n_layers=cfg.n_layers, num_pages=num_pages, page_size=page_size,
                             n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, dtype=model.dtype, device=model.device,
                             shareable=config.kv_shareable)
        # The only writer of block tables (driven by the scheduler alone), and the owner of the prefix index.
        prefix = PrefixIndex(self.pool) if config.prefix_cache_enabled else None
        self._kv = KVManager(self.pool, prefix, publication=config.publication)
        self.flights = FlightCoordinator(config.single_flight) if config.single_flight != "off" else None
        self.speculator = None
        if draft_model is not None:
            from minivllm.spec.speculator import Speculator

            self.speculator = Speculator(draft_model, draft_tokenizer if draft_tokenizer is not None else tokenizer,
                                         model, tokenizer, config, kv_tokens=num_pages * page_size,
                                         page_size=page_size, draft_name=draft_name)
        self.constraints = Constraints(tokenizer, cfg.vocab_size)  # masks for params.structured
        # The only code that runs a model (target and draft); its kernel options are this
        # engine's, passed per call, so engines forked over one model can differ in them.
        self.runner = ModelRunner(model, self.pool, config, max_model_len=self.max_model_len,
                                  constraints=self.constraints, speculator=self.speculator, draft_model=draft_model)
        self._requests: dict[str, Request] = {}
        # The only place requests advance and KV tables change.
        self._scheduler = Scheduler(config, self._kv, self.flights, max_model_len=self.max_model_len,
                                    eos_ids=tokenizer.eos_ids, requests=self._requests, speculator=self.speculator,
                                    draw_alone=self.runner.draw_alone)
        self._arrivals = itertools.count()
        self._ahead = None  # (plan, launched step, each row's start): queued by step_pipeline

    # -- submission ----------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
                    prompt: str | None = None, request_id: str | None = None, handoff: bool = False) -> str:
        """Queue a request; `handoff`: it is the prefill half of a split request, exported
        after its first token (the serving worker does that), so it may take a handoff row
        (EngineConfig.handoff_rows) when every slot is taken."""
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
        req.handoff = handoff
        self._requests[rid] = req
        if self.flights is not None:
            self.flights.join(rid, req.prompt_ids)
        if self.speculator is not None:
            self.speculator.attach(req)
        self._scheduler.add(req)
        self.counters["requests_submitted"] += 1
        return rid

    # -- moving a request to another engine (engine/handoff.py) -------------------------

    def export_request(self, request_id: str, *, copy: bool = True) -> Handoff:
        """What another engine needs to continue this request (its tokens, the K/V of its
        full computed pages, its sampler state); this engine keeps the request until told.
        `copy=False`: the K/V stay in this pool (a `PageSpan`, valid only while the request
        is held here) for a transport to copy once, straight to where they go."""
        return export_request(self._requests[request_id], self.pool, copy=copy)

    def reserve_import(self, request_id: str, token_ids: list[int]) -> dict:
        """Set free pages aside for the K/V of `token_ids` that another worker will write
        straight into this pool (`{"have": blocks cached here already, "pages": one per
        next block, "page_size"}`), for `import_request` of a `LandedBlocks` handoff or
        `drop_reservation` to end."""
        if not self._kv.caching:
            raise ConfigError("prefix_cache", False, "importing a request needs the prefix cache (kv_mode='paged')")
        r = self._scheduler.reserve_kv(request_id, token_ids)
        return {"have": r.have, "pages": list(r.pages), "page_size": self.pool.page_size}

    def drop_reservation(self, request_id: str) -> bool:
        """Give `reserve_import`'s pages back unwritten; False if there were none."""
        return self._scheduler.cancel_kv(request_id)

    def import_request(self, handoff: Handoff, *, request_id: str | None = None) -> str:
        """Continue another engine's request here: its pages go into this prefix cache
        (prefix_cache must be on), then a request with its tokens as prompt restores them.
        A `LandedBlocks` handoff was written into this request's reservation already."""
        try:
            if not self._kv.caching:
                raise ConfigError("prefix_cache", False,
                                  "importing a request needs the prefix cache (kv_mode='paged')")
            prompt_ids, params = continuation(handoff)
            if isinstance(handoff.kv, LandedBlocks):
                self._land(handoff.kv, request_id)
            else:
                self._scheduler.cancel_kv(request_id)
                self._scheduler.import_kv(handoff.kv)
        except BaseException:
            self._scheduler.cancel_kv(request_id)
            raise
        rid = self.add_request(prompt_ids, params, request_id=request_id)
        restore_generator(self._requests[rid], handoff)
        return rid

    def _land(self, landed: LandedBlocks, request_id: str | None) -> None:
        reservation = self._scheduler.reservations.get(request_id)
        if reservation is None:
            raise ConfigError("handoff", f"K/V landed for request {request_id!r}",
                              "no pages were reserved here for it (reserve_import first)")
        n = min(landed.blocks, reservation.blocks)
        if landed.token_ids[:n * self.pool.page_size] != reservation.token_ids[:n * self.pool.page_size]:
            raise ConfigError("handoff", "the landed K/V's token ids",
                              "the tokens its pages were reserved for: the exporter wrote another prefix")
        self._scheduler.land_kv(request_id, n)

    def abort(self, request_id: str) -> TokenEvent | None:
        """Cancel a request at any moment; its pages are freed at once."""
        req = self._requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return None
        return self._scheduler.finish(req, "abort", token=-1, text=req.stops.flush())

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
        s = self._scheduler
        return bool(s.waiting or s.running or s.released_events)

    @torch.inference_mode()
    def step(self) -> list[TokenEvent]:
        """One step in three calls: the scheduler plans it, the model runner runs it (draft,
        forward, draws, verification), the scheduler applies the output. Returns the token events.

        With async scheduling, a steady decode step also queues the next one before its
        tokens are read, and the next call starts from that (engine/step_pipeline.py)."""
        scheduler, runner = self._scheduler, self.runner
        with trace_scope("step", scheduler.counters["steps"]):
            plan, launched = self._take_ahead()
            if plan is None:
                plan = scheduler.schedule()
                launched = runner.launch(plan) if plan.rows else None
            hooked = scheduler.logits_hook is not None or runner.masked_logits_wanted
            if self.config.async_scheduling and steady_decode(plan, launched, hooked=hooked,
                                                              running=len(scheduler.running)):
                ahead = scheduler.plan_ahead(plan)
                if ahead is not None:
                    runner.draw_on_device(launched)  # the tokens the ahead step reads
                    queued = runner.launch_ahead(ahead)
                    if queued is not None:
                        scheduler.counters["steps_queued_ahead"] += 1
                        self._ahead = (ahead, queued, [row.request.num_computed + 1 for row in ahead.rows])
            output = runner.collect(launched) if launched is not None else None
            return scheduler.update(plan, output)

    def _take_ahead(self):
        """The step queued ahead by the last call, without the rows that call's update
        finished (or an abort since); (None, None) when there is none or no row is left."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None, None
        plan, launched, starts = ahead
        valid = still_valid(plan, starts)
        if not any(valid):
            return None, None
        if not all(valid):
            keep = {id(row) for row, ok in zip(plan.rows, valid, strict=True) if ok}
            plan.rows = [row for row in plan.rows if id(row) in keep]
            launched.rows = [r for r in launched.rows if id(r[0]) in keep]
        plan.started = time.perf_counter()  # the step's own time, not the one it overlapped
        return plan, launched

    @property
    def logits_hook(self):
        """Called as logits_hook(request_id, logits) with each appended token's float32
        logits (debug.compare records top-k logits through it); None by default."""
        return self._scheduler.logits_hook

    @logits_hook.setter
    def logits_hook(self, hook) -> None:
        self._scheduler.logits_hook = hook
        self.runner.masked_logits_wanted = hook is not None

    @property
    def counters(self) -> dict:
        return self._scheduler.counters

    @property
    def last_step(self) -> dict:
        return self._scheduler.last_step

    @property
    def kernel_options(self):
        """This engine's kernel options (resolved for its device), passed to every forward."""
        return self.runner.options

    @property
    def graph_runner(self):
        """The target's CUDA-graph runner, or None (CPU, enforce_eager)."""
        return self.runner.graphs

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
                "landing": {rid: r.held + r.pages for rid, r in self._scheduler.reservations.items()},
                "reserved": [self.graph_runner.scratch_page] if self.graph_runner is not None else []}

    def clear_prefix_cache(self) -> int:
        """Evict every idle cached page (pages in use stay cached); returns how many."""
        return self._scheduler.clear_prefix_cache()

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
