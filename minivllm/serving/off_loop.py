"""Work the HTTP handlers run off the event loop, in a form that always comes back.

`asyncio.to_thread` and `asyncio.wrap_future` carry a result or an exception from a
thread to the awaiting task, except one: a `StopIteration` cannot be set on an asyncio
Future (it would end the coroutine that awaits it as if it returned). asyncio then logs
a TypeError inside a callback and leaves the Future pending, so the handler never
resumes, never answers, and never gives back its concurrency slot (issue 39: a stray
`next()` in the chat template's control-token swap did this, and three such requests
locked the server out with 429s for good). Every call the HTTP layer offloads goes
through here, and both helpers turn a `StopIteration` into a `RuntimeError` that names
the call, which the app answers with a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class StopIterationEscaped(RuntimeError):
    """A StopIteration leaked out of offloaded work (a bug, answered with a 500)."""


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """`asyncio.to_thread(fn, *args)` whose every outcome reaches the caller."""
    def call() -> T:
        try:
            return fn(*args)
        except StopIteration as exc:
            raise StopIterationEscaped(f"{_name(fn)} raised StopIteration") from exc

    return await asyncio.to_thread(call)


async def thread_future(future: concurrent.futures.Future, what: str) -> Any:
    """Await a Future that another thread completes (`asyncio.wrap_future`, with a
    StopIteration it ends with turned into a `StopIterationEscaped` naming `what`)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def settle(done: concurrent.futures.Future) -> None:
        if waiter.done():
            return  # the awaiting task was cancelled
        if done.cancelled():
            waiter.cancel()
            return
        exc = done.exception()
        if isinstance(exc, StopIteration):
            wrapped = StopIterationEscaped(f"{what} raised StopIteration")
            wrapped.__cause__ = exc
            waiter.set_exception(wrapped)
        elif exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(done.result())

    def relay(done: concurrent.futures.Future) -> None:
        try:
            loop.call_soon_threadsafe(settle, done)
        except RuntimeError:
            pass  # the loop is closed: nobody is waiting any more

    future.add_done_callback(relay)
    return await waiter
