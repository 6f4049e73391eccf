"""`Cluster`: worker processes behind a router, as a Python object for notebooks.

    with Cluster(model="smollm2-135m", devices=["cpu", "gpu", "gpu"], router="cost") as cluster:
        stream = cluster.submit("Explain KV caches.", SamplingParams(max_tokens=64))
        for event in stream:
            print(event.text, end="")
        cluster.snapshot()   # every worker's engine snapshot + the router's decisions

`submit` routes at once and returns a `RequestStream`; iterate it with `for`, or with
`async for` when submitted from async code. The model file is resolved (downloaded if
needed) once here, before any worker starts, so workers never race on a download.
Routing decisions are serialised so each one sees the requests routed before it.

`backend="ray"` starts the same workers as Ray actors on the nodes of a Ray cluster
(ray_transport.py): each resolves the model by name on its own node, and a worker that
cannot (a node without the file) fails alone while the others start.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from minivllm.devices import resolve_dtype
from minivllm.engine.engine_config import EngineConfig
from minivllm.engine.request_checks import check_prompt, is_token_ids
from minivllm.errors import ConfigError, MinivllmError
from minivllm.sampling.outputs import RequestOutput
from minivllm.sampling.sampling_params import SamplingParams
from minivllm.serving.calibration_turns import start_in_turns
from minivllm.serving.cpu_placement import plan_cpus
from minivllm.serving.inference_devices import parse_inference_devices
from minivllm.serving.request_accounting import RequestAccounting
from minivllm.serving.request_stream import RequestStream
from minivllm.serving.router import Candidate, IncomingRequest, NoWorkerAvailable, Router
from minivllm.serving.split_request import SplitRequests, check_split, split_engine_options
from minivllm.serving.worker_handle import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, WorkerHandle
from minivllm.serving.worker_rates import profile_of
from minivllm.serving.worker_recovery import DEFAULT_MAX_WORKER_RESTARTS, WorkerSupervisor

SCHEMA = "minivllm.cluster.snapshot/1"
PREFIX_QUERY_TIMEOUT_S = 2.0


class WorkerStartError(MinivllmError):
    """A worker process could not load its model or device."""


class AdmissionRefused(MinivllmError):
    """Every worker that could take the request already has too much prompt work queued
    (`max_queued_prompt_tokens`); the HTTP API answers 429."""


# Per worker: prompt tokens still to prefill for its in-flight requests, beyond which new
# requests are refused. About 30 s of CPU prefill for a 0.5B model, a fraction of a second on a GPU.
DEFAULT_MAX_QUEUED_PROMPT_TOKENS = 32768


class Cluster:
    def __init__(self, model: str = "smollm2-135m", devices: Sequence[str] | str = ("cpu",), *, router: str = "cost",
                 dtype: str = "auto", draft_model: str | None = None, rates_profile: str | None = None,
                 calibrate: bool = True, heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S, ready_timeout_s: float = 1800.0,
                 fault_injection: bool = False, on_progress=None, progress: bool = False,
                 prompt_special_tokens: bool = True,
                 max_queued_prompt_tokens: int | None = DEFAULT_MAX_QUEUED_PROMPT_TOKENS,
                 max_worker_restarts: int = DEFAULT_MAX_WORKER_RESTARTS,
                 backend: str = "local", ray_address: str | None = "auto", trace_directory: str | None = None,
                 pin_cpus: bool = False, **engine_options):
        """`dtype` is the activation dtype of every worker, or "auto" (the default, as for
        `minivllm serve` and the launcher: f32 on CPU workers, f16 on GPU workers).
        `fault_injection=True` lets `inject_fault` make a worker's step loop hang (drills,
        tests, teaching); workers refuse it otherwise. Chat messages are
        always encoded with control tokens only where the template puts them
        (`Tokenizer.encode_chat`); `prompt_special_tokens` says whether control-token text in
        a raw string prompt becomes control ids (True, the default, as in llama.cpp and vLLM:
        the prompt is the client's own, template and all) or stays plain text (False: for
        servers whose raw prompts carry untrusted text). `max_queued_prompt_tokens` bounds
        each worker's queued prompt work (see `_admissible`; None: no bound). A worker that
        dies or is killed as hung restarts by itself, after a backoff, at most
        `max_worker_restarts` times in 10 minutes (0: never; worker_recovery.py).
        `engine_options` are EngineConfig fields (max_model_len, page_size, prefix_cache,
        batch_invariant, draft_policy, ...), applied to every worker. `on_progress(worker,
        state, stage)` is called while workers load (the widgets show it). `backend` is
        "local" (one child process per worker, the default) or "ray" (one Ray actor per
        worker on the cluster at `ray_address`: "auto", "ray://host:10001", or None for a
        private local Ray instance; needs `pip install 'minivllm[ray]'`). `trace_directory`: each
        worker writes its Chrome trace there (obs/trace.py; a split's handoff is a scope).
        `pin_cpus` (local backend): each CPU worker on cores of its own (cpu_placement.py).
        Local clusters of several workers keep handoff rows (`split_engine_options`)."""
        from minivllm.gguf.tokenizer import Tokenizer
        from minivllm.models import resolve_model

        EngineConfig(**engine_options)  # a bad option fails here, naming the field, before any process starts
        if dtype != "auto":
            resolve_dtype(dtype)
        if backend not in ("local", "ray"):
            raise ConfigError("backend", backend, "one of: local, ray")
        self.backend = backend
        self.devices = parse_inference_devices(devices, backend=backend)
        self.devices = plan_cpus(self.devices, backend=backend) if pin_cpus else self.devices
        self._ray = None
        if backend == "ray":
            from minivllm.serving.ray_transport import RayBackend

            self._ray = RayBackend(ray_address)
            self._ray.check_devices(self.devices)
        engine_options = split_engine_options(engine_options, backend, len(self.devices))
        self.router = Router(router)
        self.model_path = resolve_model(model, progress=progress)
        self.model_name = Path(model).stem if str(model).endswith(".gguf") else str(model)
        self.draft_model_path = resolve_model(draft_model, progress=progress) if draft_model else None
        self.tokenizer = Tokenizer.from_gguf(self.model_path)
        self.worker_config = {"model": str(self.model_path), "dtype": dtype,
                              "draft_model": str(self.draft_model_path) if self.draft_model_path else None,
                              "engine_options": engine_options, "calibrate": calibrate, "rates_profile": rates_profile,
                              "fault_injection": bool(fault_injection),
                              "trace_directory": None if trace_directory is None else str(trace_directory)}
        if backend == "ray":  # each node resolves the names itself and checks it has the same files
            from minivllm.models.cache import quick_fingerprint

            self.worker_config.update(
                {"model_spec": str(model), "model_fingerprint": quick_fingerprint(self.model_path)}
            )
            if draft_model:
                self.worker_config.update({"draft_model_spec": str(draft_model),
                                           "draft_model_fingerprint": quick_fingerprint(self.draft_model_path)})
        self.prompt_special_tokens = bool(prompt_special_tokens)
        if max_queued_prompt_tokens is not None and (not isinstance(max_queued_prompt_tokens, int)
                                                     or isinstance(max_queued_prompt_tokens, bool)
                                                     or max_queued_prompt_tokens < 1):
            raise ConfigError(
                "max_queued_prompt_tokens", max_queued_prompt_tokens, "must be an integer >= 1, or None for no limit"
            )
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self.admission_counters = {"refused": 0}
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.on_progress = on_progress
        self.workers: dict[str, WorkerHandle] = {}
        # Every handle this cluster ever made, so stop() reaps processes a restart replaced
        # or started late; restarts in progress by worker name (a second call joins it).
        self._spawned: list[WorkerHandle] = []
        self._lifecycle = threading.Lock()
        self._restarts: dict[str, Future] = {}
        self._closing = False
        self.restart_counters = {"started": 0, "joined": 0, "failed": 0}
        self.supervisor = WorkerSupervisor(lambda name: self.restart_worker_async(name, automatic=True),
                                           lambda name: self._worker(name).healthy, max_worker_restarts)
        self._route_lock = threading.Lock()
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:6]
        self._query_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="minivllm-prefix-query")
        self.accounting = RequestAccounting()
        self.splits = SplitRequests(self._prefix)
        self.started = False

    # -- lifecycle ---------------------------------------------------------------------------

    def _new_handle(self, device, rates: dict | None = None, on_cue: bool = False) -> WorkerHandle:
        """`rates`: a replaced worker's measured rates, which its successor (same device, same
        model) takes instead of calibrating again, so it is back sooner. `on_cue`:
        it calibrates when `start_in_turns` says (calibration_turns.py)."""
        factory = {} if self._ray is None else {"transport_factory": self._ray.transport_factory(device)}
        config = {**self.worker_config, "calibrate_on_cue": on_cue} | ({} if rates is None else {"rates": rates})
        handle = WorkerHandle(device, config, heartbeat_timeout_s=self.heartbeat_timeout_s,
                              stall_timeout_s=self.stall_timeout_s, on_progress=self.on_progress,
                              on_down=self._worker_down, **factory)
        with self._lifecycle:
            if self._closing:
                raise WorkerStartError(f"worker {device.name} was not started: the cluster is stopping")
            self._spawned.append(handle)
        return handle

    def start(self) -> "Cluster":
        """Start every worker and wait until all are loaded, warmed up and calibrated. On the
        Ray backend a worker that fails (its node lacks the model, say) stays in the snapshot
        as failed, with its error, and the others serve; only if none starts does this raise."""
        if self.started:
            return self
        if self._ray is not None:
            self._ray.ensure_connected()
        self._closing = False
        self.supervisor.resume()
        self.workers = {d.name: self._new_handle(d, on_cue=True) for d in self.devices}
        start_in_turns(list(self.workers.values()), self.ready_timeout_s)
        failed = [h for h in self.workers.values() if h.state != "ready"]
        if failed and (self.backend == "local" or len(failed) == len(self.workers)):
            message = "; ".join(
                f"{h.name}: {h.error or 'not ready after ' + str(self.ready_timeout_s) + ' s'}" for h in failed
            )
            self.stop()
            raise WorkerStartError(f"{len(failed)} of {len(self.workers)} workers did not start: {message}")
        self.splits.measure_link(self.backend, len(self.workers))
        self.splits.share_pools(self.backend, list(self.workers.values()))
        self.started = True
        return self

    def stop(self) -> None:
        """Shut every worker down; requests still running end with an error event. Every
        process this cluster started (replaced ones and those of a restart still loading
        included) is waited for, and killed if it does not exit."""
        self.supervisor.stop()
        with self._lifecycle:
            self._closing = True
            handles = list(self._spawned)
            self._spawned.clear()
        with ThreadPoolExecutor(max_workers=max(1, len(handles))) as pool:
            list(pool.map(lambda h: h.stop(), handles))
        self.splits.stop()
        if self._ray is not None:
            self._ray.close()
        self.started = False

    def restart_worker(self, name: str) -> None:
        """Replace one worker (dead or alive) with a fresh process; the others keep serving.

        Serialised per worker: a call while a restart of the same worker is in progress
        joins that restart (returns when it ends, raising its error) instead of starting
        another process. A call after it ended restarts again."""
        self.restart_worker_async(name).result()

    def restart_worker_async(self, name: str, *, automatic: bool = False) -> Future:
        """`restart_worker` without waiting: the restart in progress for `name`, or a new one
        on its own thread. The HTTP API awaits this, so joined calls hold no thread.
        `automatic`: the supervisor's (a restart by hand also resets its count)."""
        self._worker(name)
        with self._lifecycle:
            pending = self._restarts.get(name)
            if pending is not None:
                self.restart_counters["joined"] += 1
                return pending
            pending = self._restarts[name] = Future()
            # Running from the start: a caller that stops waiting (an HTTP client that left,
            # whose asyncio wrapper cancels it) cannot cancel the restart the others joined.
            pending.set_running_or_notify_cancel()
            self.restart_counters["started"] += 1
        threading.Thread(target=self._run_restart, args=(name, pending, automatic), name=f"minivllm-restart-{name}",
                         daemon=True).start()
        return pending

    def _worker_down(self, handle: WorkerHandle, cause: str) -> str | None:
        """A handle's death notice (worker_handle.on_down): the supervisor schedules the
        restart; a handle that is no longer the worker's current one is only reaped."""
        return self.supervisor.worker_down(handle.name, cause) if self.workers.get(handle.name) is handle else None

    def _run_restart(self, name: str, pending: Future, automatic: bool = False) -> None:
        try:
            self._replace_worker(name)
        except BaseException as exc:  # noqa: BLE001 - handed to every caller through the future
            with self._lifecycle:
                self._restarts.pop(name, None)
                self.restart_counters["failed"] += 1
            pending.set_exception(exc)
        else:
            with self._lifecycle:
                self._restarts.pop(name, None)
            if not automatic:
                self.supervisor.restarted_by_hand(name)
            pending.set_result(None)

    def _replace_worker(self, name: str) -> None:
        old = self.workers[name]
        old.stop()
        with self._lifecycle:
            if old in self._spawned:
                self._spawned.remove(old)  # stopped and reaped: nothing left to account for
        handle = self._new_handle(old.device, old.rates_wire if old.rates.known else None)
        self.workers[name] = handle
        handle.start()
        if not handle.wait_ready(self.ready_timeout_s) or handle.state != "ready":
            raise WorkerStartError(
                f"worker {name} did not restart: "
                f"{handle.error or 'not ready after ' + str(self.ready_timeout_s) + ' s'}"
            )
        self.splits.share_pools(self.backend, list(self.workers.values()))

    def set_router(self, policy: str) -> None:
        """Switch the routing policy; later requests use it (decisions so far are kept)."""
        router = Router(policy)
        with self._route_lock:
            router.decisions.extend(self.router.decisions)
            self.router = router

    def kill_worker(self, name: str) -> None:
        """SIGKILL one worker's process, as a crash would (fault drills, tests, the notebook)."""
        self._worker(name).kill()

    def inject_fault(self, name: str, kind: str) -> None:
        """A drill: "crash" SIGKILLs the worker; "freeze" SIGSTOPs its whole process (the
        heartbeat goes silent); "hang" blocks its step loop while the heartbeat goes on (needs
        Cluster(fault_injection=True)). The death detector must notice each one."""
        handle = self._worker(name)
        if kind == "crash":
            handle.kill()
        elif kind == "freeze":
            if self.backend != "local":
                raise ConfigError("kind", kind, "freeze stops a local process; on the Ray backend use crash (ray.kill)")
            if handle.transport is None or handle.transport.pid is None:
                raise ConfigError("worker", name, "has no process to freeze")
            os.kill(handle.transport.pid, signal.SIGSTOP)
        elif kind == "hang":
            if not self.worker_config["fault_injection"]:
                raise ConfigError("kind", kind, "start the cluster with fault_injection=True to make a worker hang")
            handle.transport.send({"op": "fault", "kind": "hang"})
        else:
            raise ConfigError("kind", kind, "one of: crash, freeze, hang")

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _worker(self, name: str) -> WorkerHandle:
        if name not in self.workers:
            raise ConfigError("worker", name, f"workers: {', '.join(self.workers) or '(none started)'}")
        return self.workers[name]

    # -- requests ------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
               chat_context: dict | None = None) -> tuple[str | None, list[int]]:
        """(prompt text, ids). Message content never becomes control tokens; a raw string
        prompt's control-token text does unless the cluster has prompt_special_tokens=False.
        `chat_context` is extra chat-template context (`tools=`)."""
        if messages is not None:
            if prompt is not None:
                raise ConfigError("messages", "<messages>", "give a prompt or messages, not both")
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, **(chat_context or {}))
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, parse_special=self.prompt_special_tokens)
        if is_token_ids(prompt):
            return None, list(prompt)
        raise ConfigError("prompt", type(prompt).__name__, "expected a string, a list of token ids, or messages=")

    def submit(self, prompt: str | list[int] | None = None, params: SamplingParams | None = None, *,
               messages: list[dict] | None = None, request_id: str | None = None, worker: str | None = None,
               loop: asyncio.AbstractEventLoop | None = None, chat_context: dict | None = None,
               placement: tuple[str, str] | None = None) -> RequestStream:
        """Route one request and send it to its worker. `worker` bypasses the router
        (the decision is still recorded, as forced); `placement=(A, B)` splits it: prefill
        and first token on worker A, decode on B, one stream (split_request.py);
        `chat_context` reaches the chat template with `messages` (e.g. `tools=[...]`).
        Raises ConfigError for a bad request and NoWorkerAvailable when every worker is down."""
        if not self.started:
            raise ConfigError("cluster", "stopped", "call start() (or use `with Cluster(...)`) before submit()")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ConfigError("params", type(params).__name__, "expected a SamplingParams")
        text, prompt_ids = self.encode(prompt, messages, chat_context)
        self._validate(prompt_ids, params)
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        rid = request_id or f"cmpl-{self._prefix}-{next(self._ids)}"
        stream = RequestStream(rid, text, prompt_ids, loop=loop, on_cancel=self._cancel,
                               on_end=self.accounting.closed, on_duplicate_end=self.accounting.duplicate)
        incoming = IncomingRequest(rid, len(prompt_ids), params.max_tokens)
        if placement is not None:  # checked before the ledger opens it
            halves = [self.workers[n] for n in check_split(placement, params, self.workers, self.backend)]
            with self._route_lock:
                self.accounting.opened(rid)
                self.router.decisions.append(self.splits.start(stream, prompt_ids, params, *halves))
            return stream
        with self._route_lock:
            handles = list(self.workers.values())
            cached = self._cached_tokens(handles, prompt_ids) if self.router.policy.startswith("cost") or worker else {}
            candidates = self._admissible(
                [h.candidate(cached.get(h.name, 0)) for h in handles], len(prompt_ids), worker
            )
            rates = {h.name: h.rates for h in handles}
            if worker is not None:
                forced = Router(f"forced:{worker}")
                decision = forced.choose(incoming, candidates, rates)
                self.router.decisions.append(decision)
            else:
                decision = self.router.choose(incoming, candidates, rates,
                                              self.splits.pricing(params, handles, self.backend))
            chosen = self.workers[decision["chosen"]]
            stream.worker, stream.decision = chosen.name, decision
            estimate = next(c["cached_tokens"] for c in decision["candidates"] if c["worker"] == chosen.name)
            self.accounting.opened(rid)
            if decision.get("split"):  # the cost router priced "prefill here, decode there" lowest
                self.splits.start(stream, prompt_ids, params, chosen, self.workers[decision["split"]["decode"]],
                                  decision)
            else:
                chosen.submit(stream, prompt_ids, params, estimate)
        return stream

    def _admissible(self, candidates: list[Candidate], prompt_tokens: int, worker: str | None) -> list[Candidate]:
        """The healthy workers whose queued prompt work leaves room for this prompt.

        A worker's queued prompt work is the prefill its in-flight requests still need
        (routing-time cache estimates for those not running yet). A worker with none takes
        any prompt that fits the context, so a long prompt is never refused outright; one
        with some takes the prompt only while the sum stays within max_queued_prompt_tokens.
        Raises AdmissionRefused (HTTP 429) when no healthy worker (or not the forced one) has room."""
        limit = self.max_queued_prompt_tokens
        if limit is None:
            return candidates

        def room(c: Candidate) -> bool:
            incoming = max(0, prompt_tokens - c.cached_tokens)
            return c.existing_prefill_tokens == 0 or c.existing_prefill_tokens + incoming <= limit

        full = [c for c in candidates if c.healthy and not room(c)]
        if not full:
            return candidates
        left = [c for c in candidates if c not in full]
        if any(c.healthy for c in left) and (worker is None or any(c.worker == worker for c in left)):
            return left
        self.admission_counters["refused"] += 1
        queued = ", ".join(f"{c.worker} has {c.existing_prefill_tokens}" for c in full)
        raise AdmissionRefused(f"no worker has room for a {prompt_tokens}-token prompt: {queued} prompt tokens queued, "
                               f"and the limit is {limit} per worker (max_queued_prompt_tokens, serve "
                               "--max-queued-prompt-tokens); retry shortly, send a shorter prompt or raise the limit")

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The checks every worker would make (engine/request_checks.py), done here so a bad
        request fails before routing; with OpenAI's stricter rule: prompt + max_tokens must
        fit the context (the engine alone would stop at max_model_len)."""
        info = next((h.info for h in self.workers.values() if h.info), {})
        check_prompt(prompt_ids, params, vocab=info.get("vocab_size"), max_model_len=info.get("max_model_len"),
                     whole_output_fits=True)

    def _cached_tokens(self, handles: list[WorkerHandle], prompt_ids: list[int]) -> dict[str, int]:
        """Ask every healthy worker at once how much of the prompt its prefix cache holds."""
        live = [h for h in handles if h.healthy]
        if not live:
            return {}
        answers = self._query_pool.map(
            lambda h: h.query("prefix_query", PREFIX_QUERY_TIMEOUT_S, prompt_ids=prompt_ids), live
        )
        return {h.name: int(a["tokens"]) if a else 0 for h, a in zip(live, answers)}

    def _cancel(self, request_id: str) -> None:
        if self.splits.cancel(request_id):
            return
        for handle in list(self.workers.values()):
            handle.abort(request_id)

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Submit all prompts at once and wait for every output (in input order)."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        streams = [self.submit(p, params) for p in prompts]
        return [s.result() for s in streams]

    # -- inspection ---------------------------------------------------------------------------------

    def health(self) -> dict:
        workers = [{"name": h.name, "device": h.device.torch_device, "state": h.state, "error": h.error,
                    "pid": h.transport.pid if h.transport else None,
                    "node": (h.transport.location if h.transport else {}).get("node_ip"),
                    "restarts": self.supervisor.describe(h.name)} for h in self.workers.values()]
        up = sum(w["state"] == "ready" for w in workers)
        status = "ok" if up == len(workers) and up else "degraded" if up else "down"
        return {"status": status, "workers": workers}

    def snapshot(self, fresh: bool = False) -> dict:
        """Every worker's latest engine snapshot (sent by the worker every 0.25 s; `fresh`
        asks each worker for a new one) plus the router's recent decisions."""
        handles = list(self.workers.values())
        if fresh:
            for h in handles:
                snap = h.query("snapshot", 10.0)
                if snap is not None:
                    with h.lock:
                        h.snapshot = snap
        return {"schema": SCHEMA, "time": time.time(), "model": self.model_name, "model_path": str(self.model_path),
                "backend": self.backend,
                "router": self.router.snapshot(), "health": self.health()["status"],
                "requests": self.accounting.as_dict(), "restarts": dict(self.restart_counters),
                "splits": self.splits.snapshot(),
                "admission": {"max_queued_prompt_tokens": self.max_queued_prompt_tokens, **self.admission_counters},
                "workers": [{**h.describe(), "restarts": self.supervisor.describe(h.name)} for h in handles]}

    def rates_profile(self) -> dict:
        """The workers' current (calibrated and corrected) rates, in the profile-file format."""
        return profile_of(self.model_name, {h.name: h.rates for h in self.workers.values()})

    def save_rates_profile(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.rates_profile(), indent=2))
        return path


__all__ = ["AdmissionRefused", "Cluster", "NoWorkerAvailable", "WorkerStartError"]
