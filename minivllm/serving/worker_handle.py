"""The controller's side of one worker: its process, its in-flight ledger, its health.

A reader thread turns the worker's messages into stream events, snapshots and rates.
It is also the death detector: a closed pipe (the process exited or was killed), a
process that is no longer alive, silence longer than `heartbeat_timeout_s` (the whole
process is frozen: SIGSTOP, swap death, a deadlock holding the GIL), or a step loop that
has not turned for `stall_timeout_s` while the heartbeat thread still talks (a kernel or
a step that never returns) marks the worker dead, and every request it held ends at once
with an error event naming the worker and the cause. A hung worker is also killed, so it
cannot come back and answer for requests already failed, and a dead one is reaped at once
(no zombie waits for a restart). `on_down(handle, cause)` is told first (the cluster's
`WorkerSupervisor` schedules the restart there) and what it returns ("restarting it
automatically in 0.5 s") ends the requests' error. The router skips dead workers from
then on, until a replacement handle is ready.

The ledger (`in_flight`) is what the cost router reads: per request the prompt size,
the cache estimate it was routed with, its budget and how many tokens it has produced.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.calibration_turns import TURN_OP, TURN_STAGE
from minivllm.serving.inference_devices import InferenceDevice
from minivllm.serving.protocol import event_from_wire, params_to_wire
from minivllm.serving.request_stream import RequestStream
from minivllm.serving.router import Candidate
from minivllm.serving.transport import ProcessTransport, TransportClosed, WorkerTransport
from minivllm.serving.worker_rates import WorkerRates

STATES = ("starting", "ready", "failed", "dead", "stopped")
DEFAULT_HEARTBEAT_TIMEOUT_S = 30.0  # the worker sends one every 0.5 s
# One step of a big prefill on a slow CPU takes seconds, never minutes.
DEFAULT_STALL_TIMEOUT_S = 120.0


@dataclass
class InFlight:
    stream: RequestStream
    prompt_tokens: int
    cached_estimate: int  # routing-time prefix-cache estimate; kept while queued
    max_tokens: int
    routed_at: float = field(default_factory=time.monotonic)
    output_tokens: int = 0
    handoff: bool = False  # a split request's prefill half: leaves after its first token, in a handoff row


class WorkerHandle:
    def __init__(
        self,
        device: InferenceDevice,
        config: dict,
        *,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        on_progress=None,
        on_down=None,
        transport_factory=ProcessTransport,
    ):
        self.device = device
        self.name = device.name
        self.config = {**config, "device": device.as_dict()}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.on_progress = on_progress
        self.on_down = on_down
        self.transport_factory = transport_factory
        self.transport: WorkerTransport | None = None
        self.state = "starting"
        self.stage = "spawning"
        self.error: str | None = None
        self.info: dict = {}
        self.rates = WorkerRates()
        self.rates_wire: dict = {}
        self.snapshot: dict | None = None
        self.running: dict[str, int] = {}  # request id -> prompt tokens computed, after the worker's last step
        self.in_flight: dict[str, InFlight] = {}
        self.reserving: dict[str, object] = {}  # split requests waiting for pages reserved here (`reserve`)
        # Split requests whose decode half will come here once their prefill worker exports
        # them: the router counts that work from the split's start (`expect`), not from its import.
        # request id -> [prefill tokens, decode tokens, context tokens] a split's decode half will bring
        self.expected: dict[str, list[int]] = {}
        self.lock = threading.RLock()
        self.last_message = time.monotonic()
        self.loop_age_s = 0.0
        self.started_at = time.time()
        self.counters = {"routed": 0, "finished": 0, "errors": 0, "rejected": 0}
        self._ready = threading.Event()
        self._settled = threading.Event()  # waiting for its calibration turn, ready or down
        self._replies: dict[int, tuple[threading.Event, list]] = {}
        self._qids = itertools.count()
        self._stopping = False
        self._lifecycle = threading.Lock()  # start() and stop() never interleave
        self._reader: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        with self._lifecycle:
            if self._stopping:  # stopped before it started: never spawn the process
                return
            self.transport = self.transport_factory("minivllm.serving.worker", self.config, name=self.name)
        self.last_message = time.monotonic()
        self._reader = threading.Thread(target=self._read, name=f"minivllm-reader-{self.name}", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float | None) -> bool:
        return self._ready.wait(timeout)

    def wait_settled(self, timeout: float | None) -> bool:
        """Until the worker waits for its calibration turn, is ready or is down
        (calibration_turns.py)."""
        return self._settled.wait(timeout)

    def give_turn(self) -> None:
        try:
            self.transport.send({"op": TURN_OP})
        except TransportClosed:
            pass  # it died waiting: the reader marks it down

    @property
    def healthy(self) -> bool:
        return self.state == "ready"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit, wait for it (killing it after `timeout`) and reap it."""
        with self._lifecycle:
            self._stopping = True
            transport = self.transport
        if transport is None:
            self._mark_down("stopped", f"worker {self.name} was stopped before it started")
            return
        try:
            self.transport.send({"op": "shutdown"})
        except TransportClosed:
            pass
        self.transport.close(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        self._mark_down("stopped", f"worker {self.name} was stopped")

    def kill(self) -> None:
        """Kill the process (tests and fault drills); the reader notices and fails its requests."""
        if self.transport is not None:
            self.transport.kill()

    # -- requests --------------------------------------------------------------------------------

    def submit(self, stream: RequestStream, prompt_ids: list[int], params: SamplingParams, cached_estimate: int,
               *, export: dict | None = None) -> None:
        """`export` ({"export_after", "segment", "await_landing", "landing_pool"}): the
        prefill half of a split request."""
        # The prefill half of a split request holds this worker for its first token only.
        flight = InFlight(stream, len(prompt_ids), cached_estimate, export["export_after"], handoff=True) \
            if export else InFlight(stream, len(prompt_ids), cached_estimate, params.max_tokens)
        self._send_request(stream, flight,
                           {"op": "submit", "request_id": stream.request_id, "prompt_ids": prompt_ids,
                            "prompt": stream.prompt, "params": params_to_wire(params), **(export or {})})

    def expect(self, request_id: str, prefill_tokens: int, decode_tokens: int, context_tokens: int = 0) -> None:
        """A split request's decode half will come here: the router sees its work queued
        here from now on, until `import_handoff` brings it or `forget` drops it, and its
        `context_tokens` (the prompt's K/V it lands with) among the rows a decode step reads."""
        with self.lock:
            self.expected[request_id] = [prefill_tokens, decode_tokens, context_tokens]

    def forget(self, request_id: str) -> None:
        with self.lock:
            self.expected.pop(request_id, None)

    def import_handoff(self, stream, handoff: dict, params: SamplingParams) -> None:
        """The decode half of a split request: continue what another worker exported
        (`handoff` is its `exported` message's description, kv_segment.py)."""
        self.forget(stream.request_id)
        tokens = len(handoff["prompt_ids"]) + len(handoff["output_ids"])
        left = params.max_tokens - len(handoff["output_ids"])
        self._send_request(stream, InFlight(stream, tokens, len(handoff["kv_token_ids"]), left),
                           {"op": "import", "request_id": stream.request_id, "handoff": handoff,
                            "params": params_to_wire(params)})

    def reserve(self, split, token_ids: list[int]) -> bool:
        """Ask for pages for a split request's K/V of `token_ids`, which its prefill worker
        will write straight into this worker's pool; the answer goes to `split.reserved`."""
        with self.lock:
            self.reserving[split.request_id] = split
        if not self._send_control({"op": "reserve", "request_id": split.request_id, "token_ids": token_ids}):
            with self.lock:
                self.reserving.pop(split.request_id, None)
            return False
        return True

    def unreserve(self, request_id: str) -> None:
        """Give back the pages `reserve` took (a no-op once imported or never reserved)."""
        self._send_control({"op": "unreserve", "request_id": request_id})

    def send_landing(self, request_id: str, landing: dict | None) -> None:
        """Tell this (prefill) worker where to write a split request's K/V (None: nowhere,
        through a segment then)."""
        self._send_control({"op": "landing", "request_id": request_id, "landing": landing})

    def prefetch_pools(self, pools: list[dict]) -> None:
        """Have this worker map (and on a GPU host-register) its peers' KV pools in the
        background, ahead of the split requests that will write into them."""
        self._send_control({"op": "prefetch_pools", "pools": pools})

    def _send_control(self, msg: dict) -> bool:
        if not self.healthy:
            return False
        try:
            self.transport.send(msg)
        except TransportClosed:
            return False
        return True

    def _send_request(self, stream, flight: InFlight, msg: dict) -> None:
        with self.lock:
            if not self.healthy:
                stream.fail(f"worker {self.name} is {self.state}: {self.error or 'not ready'}")
                return
            self.in_flight[stream.request_id] = flight
            self.counters["routed"] += 1
        try:
            self.transport.send(msg)
        except TransportClosed as exc:
            self._mark_down("dead", f"worker {self.name} is unreachable: {exc}")

    def abort(self, request_id: str) -> None:
        with self.lock:
            known = request_id in self.in_flight
        if known and self.healthy:
            try:
                self.transport.send({"op": "abort", "request_id": request_id})
            except TransportClosed:
                pass

    def query(self, op: str, timeout: float, **payload):
        """A round trip (prefix_query, snapshot); None if no answer in time or the worker is down."""
        if not self.healthy:
            return None
        qid = next(self._qids)
        done, box = threading.Event(), []
        self._replies[qid] = (done, box)
        try:
            self.transport.send({"op": op, "qid": qid, **payload})
            done.wait(timeout)
        except TransportClosed:
            pass
        finally:
            self._replies.pop(qid, None)
        return box[0] if box else None

    # -- what the router sees ------------------------------------------------------------------------

    def candidate(self, cached_tokens: int = 0) -> Candidate:
        with self.lock:
            flights = list(self.in_flight.items())
            running = dict(self.running)
            expected = [list(work) for work in self.expected.values()]  # [prefill, decode, context]
        active, queued = [], []  # [remaining prefill, remaining decode] per request, FCFS (JSON-friendly lists)
        context = 0  # the running requests' contexts: the K/V each decode step reads
        handoffs = []  # split requests' prefill halves: in handoff rows (or slots), not in the FCFS slots replayed
        for rid, f in flights:
            if f.handoff:
                handoffs.append([max(0, f.prompt_tokens - max(running.get(rid, 0), f.cached_estimate)),
                                 max(0, f.max_tokens - f.output_tokens)])
            elif f.output_tokens > 0:
                active.append([0, max(0, f.max_tokens - f.output_tokens)])
                context += f.prompt_tokens + f.output_tokens
            elif rid in running:
                active.append([max(0, f.prompt_tokens - max(running[rid], f.cached_estimate)), f.max_tokens])
                context += f.prompt_tokens
            else:
                queued.append([max(0, f.prompt_tokens - f.cached_estimate), f.max_tokens])
        # Decode halves of splits on their way here: queued behind what is here now, and rows
        # that decode with their whole prompt's K/V from the step they land in (a burst's
        # second split priced B as if the first's 4,096-token row read nothing: h100-s57).
        queued += [work[:2] for work in expected]
        context += sum(work[2] for work in expected)
        work = active + queued + handoffs
        return Candidate(
            worker=self.name,
            healthy=self.healthy,
            active=len(active),
            queued=len(queued),
            existing_prefill_tokens=sum(p for p, _ in work),
            existing_decode_tokens=sum(d for _, d in work),
            max_active=int(self.info.get("max_active_requests", 1)),
            handoff_rows=int(self.info.get("handoff_rows", 0)),
            handoffs=len(handoffs),
            context_tokens=context,
            arriving=len(expected),
            cached_tokens=cached_tokens,
            active_work=active,
            queued_work=queued,
        )

    def describe(self) -> dict:
        with self.lock:
            in_flight = [
                {
                    "request_id": rid,
                    "prompt_tokens": f.prompt_tokens,
                    "cached_estimate": f.cached_estimate,
                    "max_tokens": f.max_tokens,
                    "output_tokens": f.output_tokens,
                }
                for rid, f in self.in_flight.items()
            ]
        return {"name": self.name, "device": self.device.torch_device, "threads": self.device.threads,
                "state": self.state, "stage": self.stage, "error": self.error,
                "pid": self.transport.pid if self.transport is not None else None,
                "location": self.transport.location if self.transport is not None else {},
                "last_message_age_s": time.monotonic() - self.last_message, "loop_age_s": self.loop_age_s,
                "rates": self.rates_wire, "counters": dict(self.counters), "in_flight": in_flight,
                "info": self.info, "snapshot": self.snapshot}

    # -- the reader thread ----------------------------------------------------------------------------

    def _read(self) -> None:
        self._watch()
        if not self._stopping:
            self._reap()

    def _reap(self) -> None:
        """Wait for the dead process (killed first if it still runs), so it is never left a
        zombie; `stop` does the same for a worker asked to exit."""
        try:
            self.transport.kill()
            self.transport.close(5.0)
        except Exception:  # noqa: BLE001 - reaping is best effort; stop() tries again
            pass

    def _watch(self) -> None:
        while True:
            try:
                msg = self.transport.recv(0.5)
            except TransportClosed:
                if not self._stopping:
                    self._mark_down("dead" if self.state != "starting" else "failed",
                                    self.error or f"worker {self.name} exited ({self.transport.describe_exit()})")
                return
            now = time.monotonic()
            if msg is None:
                if self._stopping:
                    return
                if not self.transport.alive():
                    self._mark_down("dead", f"worker {self.name} exited ({self.transport.describe_exit()})")
                    return
                if self.state == "ready" and now - self.last_message > self.heartbeat_timeout_s:
                    self._mark_down("dead", f"worker {self.name} sent nothing for {now - self.last_message:.1f} s "
                                            f"(heartbeat timeout {self.heartbeat_timeout_s:g} s); killed it as hung")
                    self.transport.kill()
                    return
                continue
            self.last_message = now
            self._dispatch(msg)

    def _dispatch(self, msg: dict) -> None:
        op = msg.get("op")
        if op == "events":
            for wire in msg["events"]:
                self._deliver(wire)
        elif op == "state":
            with self.lock:
                self.snapshot = msg["snapshot"]
                self.rates_wire = msg["rates"]
                self.rates = WorkerRates.from_dict(msg["rates"])
        elif op == "progress":
            with self.lock:
                self.running = msg["running"]
        elif op == "heartbeat":
            self.loop_age_s = msg.get("loop_age_s", 0.0)
            if self.state == "ready" and self.loop_age_s > self.stall_timeout_s:
                self._mark_down("dead", f"worker {self.name}'s step loop has not turned for {self.loop_age_s:.1f} s "
                                        f"(stall timeout {self.stall_timeout_s:g} s) although its heartbeat goes on; "
                                        "killed it as hung")
                self.transport.kill()
        elif op == "reply":
            waiter = self._replies.get(msg["qid"])
            if waiter is not None:
                waiter[1].append(msg["result"])
                waiter[0].set()
        elif op == "rejected":
            with self.lock:
                flight = self.in_flight.pop(msg["request_id"], None)
                self.counters["rejected"] += 1
            if flight is not None:
                flight.stream.fail(msg["error"], rejected=True, rejected_field=msg.get("field"))
        elif op == "reserved":  # pages for a split request's K/V (split_request.py)
            with self.lock:
                split = self.reserving.pop(msg["request_id"], None)
            if split is not None:
                split.reserved(msg)
        elif op in ("exported", "imported"):  # a split request's handoff (split_request.py)
            with self.lock:
                flight = self.in_flight.get(msg["request_id"])
                if flight is not None and op == "exported":
                    del self.in_flight[msg["request_id"]]  # it left this worker
            if flight is not None:
                getattr(flight.stream, op)(msg)
        elif op == "loading":
            self.stage = msg["stage"]
            if self.stage == TURN_STAGE:
                self._settled.set()
            self._progress()
        elif op == "ready":
            self.info = msg["info"]
            self.rates_wire = msg["rates"]
            self.rates = WorkerRates.from_dict(msg["rates"])
            self.state, self.stage = "ready", "ready"
            self._ready.set()
            self._settled.set()
            self._progress()
        elif op == "failed":
            self.error = f"worker {self.name} failed to start: {msg['error']}"
            self._mark_down("failed", self.error)
        elif op == "bye":
            self._stopping = True

    def _deliver(self, wire: dict) -> None:
        event = event_from_wire(wire)
        with self.lock:
            flight = self.in_flight.get(event.request_id)
            if flight is None:
                return
            if event.token_id >= 0:
                flight.output_tokens += 1
            if event.finished:
                del self.in_flight[event.request_id]
                self.counters["finished"] += 1
                self.counters["errors"] += event.finish_reason == "error"
        flight.stream.push(event, wire.get("metrics"))

    def _mark_down(self, state: str, reason: str) -> None:
        with self.lock:
            if self.state in ("dead", "stopped", "failed") and state != "stopped":
                return
            self.state = state
            if state != "stopped":
                self.error = reason
            flights = list(self.in_flight.values())
            self.in_flight.clear()
            self.expected.clear()
            self.reserving.clear()  # their splits learn of it when their import fails
        if state == "dead" and self.on_down is not None:
            try:
                note = self.on_down(self, reason)
            except Exception as exc:  # noqa: BLE001 - the requests must still end
                note = f"its restart could not be scheduled: {type(exc).__name__}: {exc}"
            if note:
                reason = f"{reason}; {note}"
        for done, _ in list(self._replies.values()):
            done.set()
        self._ready.set()
        self._settled.set()
        for f in flights:
            f.stream.fail(reason)
        self._progress()

    def _progress(self) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress(self.name, self.state, self.stage)
            except Exception:  # noqa: BLE001 - a widget callback must not break the reader
                pass
