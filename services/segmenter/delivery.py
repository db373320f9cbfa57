"""Faust's hand-over of each fetched message to the streams, without four tasks per message.

Why: Faust's fetcher delivers every message through ``await self.wait_first(callback(message),
self.suspend_flow.wait())`` (faust/transport/consumer.py ``_drain_messages``). ``wait_first`` wraps each
argument, plus the consumer's stopped and crashed events, in a task and waits on all four: about a third of
a no-op agent's CPU per event (measured with py-spy on this machine), paid ~60 times per rollout. The
callback almost never waits: it puts the message on a stream's queue. :func:`quick_delivery` runs it inline
first and takes Faust's own path, with the callback resumed exactly where it stopped, whenever it does wait
(a full queue, a locked conductor) or the flow is already suspended, so a rebalance still cuts a blocked
delivery short exactly as before.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Coroutine
from typing import Any

from mode.services import WaitResults


def quick_delivery(consumer: Any) -> None:
    """Give ``consumer`` (a Faust consumer) a ``wait_first`` that finishes a delivery inline when it can."""
    original = consumer.wait_first
    suspend_flow = consumer.suspend_flow

    async def wait_first(*coros: Any, timeout: float | None = None) -> WaitResults:
        if len(coros) != 2 or suspend_flow.is_set() or not inspect.iscoroutine(coros[0]):
            return await original(*coros, timeout=timeout)
        delivery, suspended = coros
        try:
            yielded = delivery.send(None)
        except BaseException as finished:
            if inspect.iscoroutine(suspended):
                suspended.close()  # never started: nothing to cancel
            if isinstance(finished, StopIteration):
                return WaitResults([delivery], [finished.value], False)
            raise
        return await original(resume(delivery, yielded), suspended, timeout=timeout)

    consumer.wait_first = wait_first


async def resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Drive ``coro``, which already yielded ``yielded``, to its end as the task running it would have: wait
    for each future it yields (cleared of its blocking mark first, as a task does), then resume it so it
    reads the future's outcome itself; a bare yield is one turn of the loop; a cancellation of this task
    that did not cancel the awaited future (a bare yield) is thrown into ``coro``."""
    while True:
        cancelled = False
        if yielded is None:
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                cancelled = True
        elif asyncio.isfuture(yielded):
            yielded._asyncio_future_blocking = False
            try:
                await yielded
            except (Exception, asyncio.CancelledError):  # the future's outcome, read again by ``coro``; or
                cancelled = not yielded.done()  # this task's cancellation (KeyboardInterrupt etc. propagate)
        else:
            raise RuntimeError(f"a delivery yielded {yielded!r}, which is not a future")
        try:
            yielded = coro.throw(asyncio.CancelledError()) if cancelled else coro.send(None)
        except StopIteration as done:
            return done.value
