"""`RequestStream`: one request's token events, for threads and for asyncio alike.

The controller's reader thread pushes events; a consumer iterates with `for` (blocking)
or `async for` (when the stream was bound to an event loop at submission). Leaving the
loop early, by break, exception or task cancellation, cancels the request on its worker,
which frees its pages: an HTTP client that disconnects ends up here.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

from minivllm.sampling.outputs import RequestMetrics, RequestOutput, TokenEvent


class RequestStream:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], *,
                 loop: asyncio.AbstractEventLoop | None = None, on_cancel=None, on_end=None, on_duplicate_end=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.worker: str | None = None  # set when routed
        self.decision: dict | None = None  # the router's record for this request
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.rejected: dict | None = None  # {"field", "error"} when the worker refused it
        self.metrics: dict | None = None  # RequestMetrics.as_dict() once finished
        self._events: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self._loop = loop
        self._async_events: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._done = threading.Event()
        self._on_cancel = on_cancel
        # Accounting hooks: on_end(request_id, finish_reason) runs once, at the terminal
        # event; on_duplicate_end(request_id) for any terminal event after that one.
        self._on_end = on_end
        self._on_duplicate_end = on_duplicate_end
        # Client-side timestamps (time.perf_counter()): benchmarks measure TTFT and e2e
        # from these, as a client of the cluster would see them.
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    # -- producer side (the controller's reader thread) ------------------------------------

    def push(self, event: TokenEvent, metrics: dict | None = None) -> None:
        if self._done.is_set():
            # Exactly one terminal event per request: a later one is counted, never delivered.
            if event.finished and self._on_duplicate_end is not None:
                self._on_duplicate_end(self.request_id)
            return
        now = time.perf_counter()
        if event.token_id >= 0:
            self.token_ids.append(event.token_id)
            if self.first_token_at is None:
                self.first_token_at = now
        self.text += event.text
        if event.finished:
            self.finished_at = now
            self.finish_reason = event.finish_reason
            self.error = event.error
            self.metrics = metrics
            self._done.set()
            if self._on_end is not None:
                self._on_end(self.request_id, event.finish_reason)
        self._events.put(event)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_events.put_nowait, event)
            except RuntimeError:
                pass  # the consumer's loop is closed: nobody is listening any more

    def fail(self, message: str, *, rejected_field: str | None = None, rejected: bool = False) -> None:
        if rejected:
            self.rejected = {"field": rejected_field, "error": message}
        self.push(TokenEvent(self.request_id, -1, "", finished=True, finish_reason="error", error=message))

    # -- consumer side ---------------------------------------------------------------------------

    def cancel(self) -> None:
        if not self._done.is_set() and self._on_cancel is not None:
            self._on_cancel(self.request_id)

    def __iter__(self):
        finished = False
        try:
            while not finished:
                event = self._events.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.cancel()

    async def __aiter__(self):
        if self._async_events is None:
            raise RuntimeError("this stream was submitted outside an event loop; iterate it with `for`, "
                               "or submit from async code (or pass loop=) to use `async for`")
        finished = False
        try:
            while not finished:
                event = await self._async_events.get()
                finished = event.finished
                yield event
        finally:
            if not finished:
                self.cancel()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end and return the whole output (does not consume the iterator)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        metrics = RequestMetrics()
        if self.metrics:
            for key, value in self.metrics.items():
                if hasattr(metrics, key) and not isinstance(getattr(type(metrics), key, None), property):
                    setattr(metrics, key, value)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), list(self.token_ids),
                             self.text, self.finish_reason, metrics, self.error)
