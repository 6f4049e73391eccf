"""`off_loop`: offloaded work always comes back to the awaiting task.

The reference is asyncio itself: the first test shows that a bare `asyncio.to_thread`
whose function raises StopIteration never resumes its caller (the failure the helpers
exist for); the others show that through the helpers every outcome (a value, an
exception, StopIteration, a cancelled Future) arrives within a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from minivllm.serving.off_loop import StopIterationEscaped, in_thread, thread_future

DEADLINE_S = 10.0  # liveness only


def stop():
    raise StopIteration


def later(outcome) -> concurrent.futures.Future:
    """A Future another thread completes after a moment."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def settle():
        if outcome == "cancel":
            future.cancel()
        elif isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    threading.Timer(0.05, settle).start()
    return future


def test_bare_to_thread_never_returns_from_a_stopiteration():
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.to_thread(stop), 1.0)
    asyncio.run(main())


def test_in_thread_returns_values_and_raises_what_the_call_raised():
    async def main():
        assert await asyncio.wait_for(in_thread(lambda a, b: a + b, 2, 3), DEADLINE_S) == 5
        with pytest.raises(KeyError):
            await asyncio.wait_for(in_thread({}.__getitem__, "k"), DEADLINE_S)
        with pytest.raises(StopIterationEscaped, match="stop raised StopIteration") as info:
            await asyncio.wait_for(in_thread(stop), DEADLINE_S)
        assert isinstance(info.value.__cause__, StopIteration)
        with pytest.raises(StopIterationEscaped):
            await asyncio.wait_for(in_thread(next, iter(())), DEADLINE_S)
    asyncio.run(main())


def test_thread_future_carries_every_outcome():
    async def main():
        assert await asyncio.wait_for(thread_future(later(7), "seven"), DEADLINE_S) == 7
        with pytest.raises(ValueError):
            await asyncio.wait_for(thread_future(later(ValueError("bad")), "bad"), DEADLINE_S)
        with pytest.raises(StopIterationEscaped, match="the restart raised StopIteration"):
            await asyncio.wait_for(thread_future(later(StopIteration()), "the restart"), DEADLINE_S)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(thread_future(later("cancel"), "cancelled"), DEADLINE_S)
        done = concurrent.futures.Future()
        done.set_result("already")
        assert await asyncio.wait_for(thread_future(done, "done"), DEADLINE_S) == "already"
    asyncio.run(main())
