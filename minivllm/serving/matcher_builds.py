"""A worker's constrained submissions, held until their llguidance matcher is built on a
thread of its own, so neither the step loop nor the receiver thread waits on a grammar.

Building a matcher against the vocabulary is the one compile a worker does (the
controller vetted and compiled the grammar text already, constraint_compiler.py). For the
largest constraints the bounds admit it takes about a second (1.0 s for a 2,500-property
schema on SmolLM2's 49k tokens), and llguidance runs it without the GIL. Done on the
receiver thread, it held up every message behind it: other submissions, aborts, and the
router's prefix-cache queries, so each new request, on any worker, waited for it
(measured: unrelated streams' TTFT 8.2 s, against 0.4 s, beside two such schemas).

    builds.start(msg)        receiver thread: parse the params, start the build
    builds.hold(msg)         step loop: True if the build is still running (the request waits here)
    builds.abort(rid)        step loop: True if that request is held (it is aborted once built)
    builds.done()            step loop, every turn: the held submissions now ready, in order
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from minivllm.serving.protocol import params_from_wire

BUILD_THREADS = 1  # builds are CPU-bound: one at a time leaves the other cores to the step loop
BUILD_NICENESS = 10  # and below the step loops' priority, so a busy host serves the streams first


def _lower_priority() -> None:
    """Linux schedules threads one by one: this lowers only the build thread's priority."""
    import os
    import threading

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BUILD_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: same priority as the rest
        pass


class MatcherBuilds:
    def __init__(self, constraints):
        self._constraints = constraints
        self._pool = ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="minivllm-worker-matchers",
                                        initializer=_lower_priority)
        self._held: dict[str, dict] = {}  # request id -> its submission, in arrival order

    def start(self, msg: dict) -> dict:
        """The submission with its params parsed ("parsed_params") and, when it is
        constrained, its build started ("matcher_ready"). A bad one is left as it came,
        for the step loop to reject."""
        try:
            params = params_from_wire(msg["params"])
        except Exception:  # noqa: BLE001 - the step loop parses again and reports it
            return msg
        out = {**msg, "parsed_params": params}
        if params.structured is not None:
            out["matcher_ready"] = self._pool.submit(self._constraints.prepare, params.structured)
        return out

    def hold(self, msg: dict) -> bool:
        ready: Future | None = msg.get("matcher_ready")
        if ready is None or ready.done():
            return False
        self._held[msg["request_id"]] = msg
        return True

    def abort(self, request_id: str) -> bool:
        msg = self._held.get(request_id)
        if msg is not None:
            msg["aborted"] = True  # submitted and aborted at once when built, so the controller hears of it
        return msg is not None

    def done(self) -> list[dict]:
        ready = [rid for rid, msg in self._held.items() if msg["matcher_ready"].done()]
        return [self._held.pop(rid) for rid in ready]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
