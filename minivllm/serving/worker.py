"""The worker process: one device, one engine, driven by messages from the controller.

`python -m minivllm.serving.worker FD` is the process entry point (transport.py starts
it); `serve_worker(endpoint, config)` runs a worker on any endpoint with `send(dict)` and
`recv(timeout) -> dict | None` (the Ray actor of ray_actor.py hosts one that way).

Threads inside the worker:
- the step loop (main thread) owns the engine. It is the engine's own loop,
  `LLMEngine.run`, the same one `LLM.generate` turns: this module only supplies its
  `between_steps` hook (apply submissions and aborts, wait for work while idle, send a
  state snapshot every interval) and handles each step's events. There is no second,
  thread-based async loop (the old `AsyncEngine` is gone): asynchronous callers go through
  the controller (`Cluster` and its `RequestStream`s), which talks to this loop;
- a receiver thread reads the pipe. It answers prefix-cache queries at once (a read-only
  lookup, so routing never waits for a long prefill step) and queues everything else for
  the step loop. When the controller goes away it stops the worker;
- a heartbeat thread says "alive, and the step loop last turned N seconds ago", so the
  controller can tell a dead or wedged worker from a busy one;
- a matcher thread builds constrained requests' llguidance matchers; such a request
  reaches the engine once its matcher is ready (matcher_builds.py).

A split request (issue 43, split_request.py) passes through two workers: the prefill
worker gets a `submit` with `export_after` and exports the request right after the step
that gave it that many tokens (its K/V into a shared-memory segment, kv_segment.py), then
lets it go; the decode worker gets an `import` and continues it (`_import`).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback

from minivllm.cache.shared_pool_memory import prefetch as prefetch_pool
from minivllm.errors import ConfigError, MinivllmError
from minivllm.obs.trace import enable_tracing, flush_trace, trace_scope
from minivllm.serving.calibration_turns import StoppedBeforeReady, wait_for_turn
from minivllm.serving.cpu_placement import apply_cpus
from minivllm.serving.kv_landing import handoff_from_landing, handoff_to_landing, zero_copy_requested
from minivllm.serving.kv_segment import handoff_from_wire, handoff_to_wire, unlink_segment
from minivllm.serving.matcher_builds import MatcherBuilds
from minivllm.serving.protocol import event_to_wire, params_from_wire
from minivllm.serving.transport import Endpoint, TransportClosed
from minivllm.serving.worker_rates import WorkerRates, load_profile

DEFAULT_STATE_INTERVAL_S = 0.25
DEFAULT_HEARTBEAT_S = 0.5
# How long a split request whose first token is due waits (decoding on here meanwhile) for
# the decode worker's reserved pages before it goes through a segment instead.
LANDING_WAIT_S = 1.0


def worker_main(conn, config: dict | None = None) -> None:
    """Serve on `conn` (a multiprocessing Connection); without `config`, the first
    message on it is the config."""
    endpoint = Endpoint(conn)
    if config is None:
        try:
            config = endpoint.recv(None)
        except TransportClosed:
            return
    serve_worker(endpoint, config)


def serve_worker(endpoint, config: dict) -> None:
    """Load the engine, then run the step loop until shutdown; a load failure is reported
    as one `failed` message (naming the node when the transport placed us on one)."""
    try:
        worker = Worker(config, endpoint)
    except StoppedBeforeReady:
        return
    except BaseException as exc:  # noqa: BLE001 - everything must reach the controller
        message = (
            str(exc) if isinstance(exc, MinivllmError) else f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        )
        where = (config.get("placement") or {}).get("where")
        if where:
            message = f"on {where}: {message}"
        try:
            endpoint.send({"op": "failed", "error": message})
        except TransportClosed:
            pass
        return
    worker.run()
    flush_trace()  # a no-op unless tracing; written here too since a stopped process may skip atexit


class Worker:
    def __init__(self, config: dict, endpoint: Endpoint):
        import torch

        from minivllm.engine.llm import LLM
        from minivllm.serving.calibration import calibrate, warm_up

        self.endpoint = endpoint
        self.config = config
        device = config["device"]
        self.name = device["name"]
        apply_cpus(device.get("cpus"))  # before torch.set_num_threads: its threads inherit the mask
        torch.set_num_threads(int(device.get("threads") or 1))
        if config.get("trace_directory"):  # one Perfetto file per worker process, opened together
            enable_tracing(config["trace_directory"], process_name=f"minivllm worker {self.name}")
        endpoint.send({"op": "loading", "stage": "model"})
        dtype = config.get("dtype") or "f32"
        if dtype == "auto":  # f32 where it is fast (CPU), f16 on GPUs (a T4 has no bf16)
            dtype = "f32" if device["kind"] == "cpu" else "f16"
        zero_copy_requested()  # a misspelt MINIVLLM_EXPORT_ZERO_COPY stops the start, named, not a split later
        options = dict(config.get("engine_options", {}))
        if device["kind"] == "cpu":  # a split request's prefill worker writes into this pool directly
            options.setdefault("kv_shareable", True)
        self.llm = LLM(config["model"], device=device["torch_device"], dtype=dtype,
                       progress=False, draft_model=config.get("draft_model"), **options)
        self.engine = self.llm.engine
        endpoint.send({"op": "loading", "stage": "warm-up"})
        warm_up(self.engine)
        early: list[dict] = []  # messages that came while it waited for its calibration turn
        if config.get("rates_profile"):
            self.rates = load_profile(config["rates_profile"], self.name)
        elif config.get("rates"):  # a restart: the rates the worker it replaces measured here
            self.rates = WorkerRates.from_dict(config["rates"])
            self.rates.source = "predecessor"
        elif config.get("calibrate", True):
            if config.get("calibrate_on_cue"):  # after every worker's warm-up, alone (calibration_turns.py)
                early = wait_for_turn(endpoint)
            endpoint.send({"op": "loading", "stage": "calibration"})
            self.rates = calibrate(self.engine)
        else:
            self.rates = WorkerRates()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.matcher_builds = MatcherBuilds(self.engine.constraints)  # constrained submissions wait there
        for msg in early:
            self._route(msg)
        self.stopping = threading.Event()
        self.last_loop = time.monotonic()
        self._last_running: dict[str, int] = {}
        self.exports: dict[str, dict] = {}  # split requests here: id -> how and when they leave (_export_due)
        self._last_state = 0.0  # when the last state snapshot went out
        self.state_interval = float(config.get("state_interval_s", DEFAULT_STATE_INTERVAL_S))
        self.heartbeat_s = float(config.get("heartbeat_s", DEFAULT_HEARTBEAT_S))
        info = {
            **self.llm.info(),
            "name": self.name,
            "pid": os.getpid(),
            "device_spec": device,
            "placement": config.get("placement") or {},
            "vocab_size": self.llm.model.config.vocab_size,
            "max_active_requests": self.engine.config.max_active_requests,
            "handoff_rows": self.engine.config.handoff_rows,
            "page_size": self.engine.pool.page_size,
            # Where a split request's prefill worker may write its K/V straight in (kv_landing.py).
            "kv_landing": self.engine.pool.shared.describe() if self.engine.pool.shared is not None else None,
        }
        endpoint.send({"op": "ready", "info": info, "rates": self.rates.as_dict()})

    # -- threads ------------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self._receive, name="minivllm-worker-recv", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="minivllm-worker-heartbeat", daemon=True).start()
        try:
            self._loop()
        except TransportClosed:
            pass  # the controller is gone; nothing left to report to
        finally:
            self.stopping.set()
            self.matcher_builds.close()

    def _receive(self) -> None:
        while not self.stopping.is_set():
            try:
                msg = self.endpoint.recv(None)
            except TransportClosed:
                # The controller died or closed the pipe: nobody can receive our tokens.
                self.stopping.set()
                self.inbox.put({"op": "shutdown"})
                return
            self._route(msg)

    def _route(self, msg: dict) -> None:
        """A message from the controller: prefix queries answered here, on the receiving
        thread; submissions through their matcher build; the rest to the step loop."""
        if msg.get("op") == "prefix_query":
            self._send({"op": "reply", "qid": msg["qid"], "result": {"tokens": self._cached_tokens(msg["prompt_ids"])}})
        elif msg.get("op") == "submit":
            self.inbox.put(self.matcher_builds.start(msg))
        else:
            self.inbox.put(msg)

    def _heartbeat(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            self._send({"op": "heartbeat", "loop_age_s": time.monotonic() - self.last_loop})

    def _send(self, msg: dict) -> None:
        try:
            self.endpoint.send(msg)
        except TransportClosed:
            self.stopping.set()

    # -- the step loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        for events in self.engine.run(self._between_steps, on_error=self._fail_everything):
            self._after_step(events)

    def _between_steps(self, busy: bool) -> bool:
        """Before every turn of the engine's loop: report state when due, apply what the
        inbox holds (waiting for it briefly when the engine is idle). False ends the loop."""
        now = time.monotonic()
        self.last_loop = now
        if now - self._last_state >= self.state_interval:
            self._send({"op": "state", "snapshot": self.engine.snapshot(), "rates": self.rates.as_dict()})
            self._last_state = now
        for msg in self.matcher_builds.done():
            self._submit(msg)
            if msg.get("aborted"):
                self._handle({"op": "abort", "request_id": msg["request_id"]})
        try:
            msg = self.inbox.get_nowait() if busy else self.inbox.get(timeout=0.05)
            while True:
                if self._handle(msg) == "shutdown":
                    self._send({"op": "bye"})
                    return False
                msg = self.inbox.get_nowait()
        except queue.Empty:
            pass
        return not self.stopping.is_set()

    def _handle(self, msg: dict) -> str | None:
        op = msg.get("op")
        if op == "submit":
            if not self.matcher_builds.hold(msg):
                self._submit(msg)
        elif op == "abort" and self.matcher_builds.abort(msg["request_id"]):
            pass  # still building its matcher: aborted once it is in
        elif op == "abort":
            self.exports.pop(msg["request_id"], None)
            event = self.engine.abort(msg["request_id"])
            if event is not None:
                self._send_events([event])
        elif op == "import":
            self._import(msg)
        elif op == "reserve":  # the decode half of a split request, before its prefill is done
            self._reserve(msg)
        elif op == "unreserve":
            self.engine.drop_reservation(msg["request_id"])
        elif op == "landing" and msg["request_id"] in self.exports:
            export = self.exports[msg["request_id"]]
            export["landing"], export["await_landing"] = msg["landing"], False  # None: through the segment
        elif op == "prefetch_pools":  # peers' pools, mapped in the background (split requests)
            for pool in msg["pools"]:
                prefetch_pool(pool, self.engine.pool.k.device)
        elif op == "snapshot":
            self._send({"op": "reply", "qid": msg["qid"], "result": self.engine.snapshot()})
        elif op == "shutdown":
            return "shutdown"
        elif op == "fault" and self.config.get("fault_injection") and msg.get("kind") == "hang":
            # A drill: the step loop stops turning while the heartbeat thread goes on, as a
            # kernel that never returns would; the controller must detect it and kill us.
            self.stopping.wait()
        return None

    def _submit(self, msg: dict) -> None:
        rid = msg["request_id"]
        try:
            params = msg.get("parsed_params") or params_from_wire(msg["params"])
            self.engine.add_request(msg["prompt_ids"], params, prompt=msg.get("prompt"), request_id=rid,
                                    handoff=bool(msg.get("export_after")))
            if msg.get("export_after"):
                self.exports[rid] = {"after": int(msg["export_after"]), "segment": msg["segment"],
                                     "await_landing": bool(msg.get("await_landing")), "landing": None, "due": None}
                if msg.get("landing_pool"):  # mapped (and host-registered) while the prefill runs
                    prefetch_pool(msg["landing_pool"], self.engine.pool.k.device)
        except ConfigError as exc:
            self._send({"op": "rejected", "request_id": rid, "field": exc.field, "error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - a bad request must not take the worker down
            self._send({"op": "rejected", "request_id": rid, "field": None, "error": f"{type(exc).__name__}: {exc}"})

    def _fail_everything(self, exc: Exception) -> list:
        """The last net: the engine contains its errors, so a step that raises is a bug.
        Finish everything still in flight with the error instead of dying with it."""
        engine = self.engine
        message = f"worker {self.name}: engine step failed: {type(exc).__name__}: {exc}"
        events = []
        for rid in engine.request_ids():
            event = engine.abort(rid)
            if event is not None:
                event.finish_reason, event.error = "error", message
                events.append(event)
        return events

    def _after_step(self, events) -> None:
        engine = self.engine
        step = engine.last_step
        if not any(row.get("draft_tokens") for row in step["rows"]):
            self.rates.observe_step(step["prefill_tokens"], step["decode_rows"], step["duration_s"],
                                    step["decode_context_tokens"])
        self._send_events(events)
        if self.exports:
            self._export_due()
        # Which requests hold pages now, and how far their prompts are: a few ids per step,
        # so the router's active/queued split lags by one step, not by a state interval.
        running = engine.progress()
        if running != self._last_running:
            self._send({"op": "progress", "running": running})
            self._last_running = running

    def _export_due(self) -> None:
        """Split requests that have their tokens here leave now, before another step: the
        K/V into the decode worker's reserved pages (its landing, when one came in time) or
        else into their segment, one `exported` message, then the request and its pages go."""
        engine = self.engine
        for rid, export in list(self.exports.items()):
            try:
                state = engine.request_state(rid)
            except KeyError:  # finished here (and popped) before it was due
                state = None
            if state is None or state.finished:
                del self.exports[rid]
                continue
            if len(state.output_ids) < export["after"]:
                continue
            export["due"] = export["due"] or time.monotonic()
            if export["await_landing"] and export["landing"] is None \
                    and time.monotonic() - export["due"] < LANDING_WAIT_S:
                continue  # the decode worker's reservation is on its way; the request goes on here meanwhile
            del self.exports[rid]
            started = time.time()
            try:
                with trace_scope("handoff", "export", request=rid):
                    handoff = engine.export_request(rid, copy=False)  # its pages, copied once below
                    meta, landing_error = None, None
                    if export["landing"] is not None:
                        try:
                            meta = handoff_to_landing(handoff, export["landing"])
                        except (OSError, RuntimeError) as exc:  # the pool cannot be mapped or written from here
                            landing_error = f"{type(exc).__name__}: {exc}"[:300]
                    if meta is None:  # the segment carries them; the import gives the reservation back
                        meta = {**handoff_to_wire(handoff, export["segment"]), "landing_error": landing_error}
            except Exception as exc:  # noqa: BLE001 - this request fails, the worker goes on
                unlink_segment(export["segment"])
                event = engine.abort(rid)
                if event is not None:
                    event.finish_reason = "error"
                    event.error = f"worker {self.name}: exporting the request failed: {type(exc).__name__}: {exc}"
                    self._send_events([event])
                continue
            metrics = engine.output(rid).metrics.as_dict()
            engine.release(rid)
            self._send({"op": "exported", "request_id": rid, "handoff": meta, "metrics": metrics,
                        "started_at": started, "export_ms": (time.time() - started) * 1e3})

    def _reserve(self, msg: dict) -> None:
        """Pages for a split request's K/V, which its prefill worker will write in directly."""
        rid = msg["request_id"]
        try:
            landing = {**self.engine.reserve_import(rid, msg["token_ids"]), "pool": self.engine.pool.shared.describe()}
        except Exception as exc:  # noqa: BLE001 - no landing: the split goes through a segment
            self.engine.drop_reservation(rid)
            self._send({"op": "reserved", "request_id": rid, "landing": None, "error": f"{type(exc).__name__}: {exc}"})
            return
        self._send({"op": "reserved", "request_id": rid, "landing": landing})

    def _import(self, msg: dict) -> None:
        """Continue a split request exported by another worker: its K/V landed in this pool's
        reserved pages already, or wait in a segment, gone after this."""
        rid, meta = msg["request_id"], msg["handoff"]
        started = time.perf_counter()
        try:
            with trace_scope("handoff", "import", request=rid):
                params = params_from_wire(msg["params"])
                if "landed" in meta:
                    handoff = handoff_from_landing(meta, params)  # only indexed here: no copy
                else:
                    handoff = handoff_from_wire(meta, params)  # views of the segment
                self.engine.import_request(handoff, request_id=rid)  # a segment's one copy, into this pool's pages
                read_ms = (time.perf_counter() - started) * 1e3  # the read side of the link: map and copy
        except Exception as exc:  # noqa: BLE001 - a bad import fails its request, not the worker
            if meta.get("segment"):
                unlink_segment(meta["segment"])
            self.engine.drop_reservation(rid)
            field = exc.field if isinstance(exc, ConfigError) else None
            self._send({"op": "rejected", "request_id": rid, "field": field,
                        "error": f"worker {self.name} could not import the request: {type(exc).__name__}: {exc}"})
            return
        self._send({"op": "imported", "request_id": rid, "read_ms": read_ms, "finished_at": time.time(),
                    "import_ms": (time.perf_counter() - started) * 1e3, "landed": "landed" in meta})

    def _send_events(self, events) -> None:
        wire = []
        held = set(self.engine.request_ids()) if any(e.finished for e in events) else set()
        for event in events:
            metrics = None
            if event.finished and event.request_id in held:
                held.discard(event.request_id)
                metrics = self.engine.pop_output(event.request_id).metrics.as_dict()
            wire.append(event_to_wire(event, metrics))
        if wire:
            self._send({"op": "events", "events": wire})

    def _cached_tokens(self, prompt_ids: list[int]) -> int:
        """How many leading tokens of this prompt the prefix cache could restore now.
        Called from the receiver thread while the step loop may be publishing: the engine
        answers with a read-only lookup, at worst slightly stale, which is all a routing
        estimate needs."""
        return self.engine.cached_prefix_tokens(prompt_ids)


if __name__ == "__main__":
    import sys
    from multiprocessing.connection import Connection

    worker_main(Connection(int(sys.argv[1])))
