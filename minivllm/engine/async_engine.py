"""`AsyncEngine`: the step loop on a background thread, token events as async iterators.

    engine = AsyncEngine(LLMEngine(model, tokenizer, config))
    async for event in engine.generate(prompt_ids, SamplingParams(max_tokens=64)):
        print(event.text, end="")

One thread owns the `LLMEngine` and calls `step()` while any request is unfinished;
submissions and cancellations take the same lock, so they land between steps. Events
cross to each caller's event loop with `call_soon_threadsafe`. Leaving the `async for`
early (break, exception, task cancellation) aborts the request and frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from minivllm.engine.engine import LLMEngine
from minivllm.sampling.outputs import RequestOutput, TokenEvent
from minivllm.sampling.sampling_params import SamplingParams


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        # Callers announce themselves before taking the lock; the engine thread steps
        # aside for them between steps. Without this, a busy engine thread re-takes the
        # (unfair) lock right after each step and a cancel can wait for the whole request.
        self._waiting_callers = 0
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
                       prompt: str | None = None, request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        with self._turn():
            rid = self.engine.add_request(prompt_ids, params, prompt=prompt, request_id=request_id)
            self._subscribers[rid] = (loop, queue)
        finished = False
        try:
            while not finished:
                event = await queue.get()
                finished = event.finished
                yield event
        finally:
            with self._turn():
                self._subscribers.pop(rid, None)
                if not finished:
                    self.engine.abort(rid)
                self.engine.requests.pop(rid, None)

    async def complete(self, prompt_ids: list[int], params: SamplingParams | None = None, **kw) -> RequestOutput:
        """Run one request to the end and return its output."""
        rid, out = None, None
        async for event in self.generate(prompt_ids, params, **kw):
            rid = event.request_id
            if event.finished:
                with self._lock:
                    out = self.engine.output(rid)
        return out

    def abort(self, request_id: str) -> None:
        with self._turn():
            event = self.engine.abort(request_id)
            if event is not None:
                self._deliver([event])

    def snapshot(self) -> dict:
        with self._lock:
            return self.engine.snapshot()

    def shutdown(self) -> None:
        with self._work:
            self._stopped = True
            self._work.notify()
        self._thread.join(timeout=10)

    # -- the engine thread -----------------------------------------------------------------

    @contextlib.contextmanager
    def _turn(self):
        """The engine lock for a caller, taken between two steps."""
        with self._count_lock:
            self._waiting_callers += 1
        with self._work:
            with self._count_lock:
                self._waiting_callers -= 1
            yield
            self._work.notify_all()

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._stopped and (self._waiting_callers or not self.engine.has_unfinished()):
                    self._work.wait(timeout=0.05)
                if self._stopped:
                    return
                events = self.engine.step()
                self._deliver(events)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            sub = self._subscribers.get(event.request_id)
            if sub is not None:
                loop, queue = sub
                loop.call_soon_threadsafe(queue.put_nowait, event)
