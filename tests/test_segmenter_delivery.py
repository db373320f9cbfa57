"""quick_delivery: Faust's per-message hand-over finished inline when it need not wait, Faust's own path
(cut short by a suspended flow) when it must; the same results, exceptions and cancellations either way."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest
from mode import Service
from mode.utils.locks import Event

from services.segmenter.delivery import quick_delivery


class Consumer(Service):
    """What quick_delivery touches of a Faust consumer: mode's real ``wait_first`` and ``suspend_flow``."""

    def __init__(self) -> None:
        super().__init__()
        self.suspend_flow = Event()
        self.slow_path = 0
        original = self.wait_first

        async def counted(*coros, timeout=None):
            self.slow_path += 1
            return await original(*coros, timeout=timeout)

        self.wait_first = counted
        quick_delivery(self)

    async def deliver(self, coro) -> object:
        """As Faust's fetcher does it (faust/transport/consumer.py ``_drain_messages``)."""
        return await self.wait_first(coro, self.suspend_flow.wait())


async def test_a_delivery_that_need_not_wait_is_finished_inline_and_leaves_nothing_unawaited() -> None:
    consumer, queue = Consumer(), asyncio.Queue(maxsize=4)

    async def put(message: str) -> str:
        await queue.put(message)  # room on the queue: no suspension
        return message

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "coroutine ... was never awaited" would fail the test
        results = [await consumer.deliver(put(m)) for m in ("a", "b", "c")]
        gc.collect()
    assert [r.results for r in results] == [["a"], ["b"], ["c"]] and not any(r.stopped for r in results)
    assert [queue.get_nowait() for _ in range(3)] == ["a", "b", "c"] and consumer.slow_path == 0


async def test_a_delivery_that_waits_is_resumed_where_it_stopped_through_faust_s_path() -> None:
    consumer, queue = Consumer(), asyncio.Queue(maxsize=1)
    queue.put_nowait("full")
    steps: list[str] = []

    async def put(message: str) -> str:
        steps.append("before")
        await asyncio.sleep(0)  # a bare yield
        await queue.put(message)  # a full queue: waits for the consumer below
        done, _ = await asyncio.wait([asyncio.ensure_future(asyncio.sleep(0.01))])  # what the conductor does
        steps.append("after")
        return message

    async def drain() -> str:
        await asyncio.sleep(0.05)
        return queue.get_nowait()

    result, first = await asyncio.gather(consumer.deliver(put("m")), drain())
    assert result.results == ["m"] and first == "full" and queue.get_nowait() == "m"
    assert steps == ["before", "after"] and consumer.slow_path == 1


async def test_a_suspended_flow_cuts_a_blocked_delivery_short_and_cancels_it() -> None:
    """A rebalance sets ``suspend_flow``: Faust gives up a delivery stuck on a full queue, the delivery
    sees a cancellation where it waited, and nothing is put."""
    consumer, queue = Consumer(), asyncio.Queue(maxsize=1)
    queue.put_nowait("full")
    seen: list[str] = []

    async def put(message: str) -> str:
        try:
            await queue.put(message)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return message

    asyncio.get_running_loop().call_later(0.05, consumer.suspend_flow.set)
    result = await consumer.deliver(put("m"))
    await asyncio.sleep(0.01)
    assert result.results == [True] and seen == ["cancelled"]  # the suspend_flow waiter won
    assert queue.qsize() == 1 and queue.get_nowait() == "full"


async def test_with_the_flow_suspended_faust_s_path_is_taken_from_the_start() -> None:
    consumer = Consumer()
    consumer.suspend_flow.set()

    async def put() -> str:
        return "m"

    assert (await consumer.deliver(put())).results and consumer.slow_path == 1


@pytest.mark.parametrize("waits", [False, True], ids=["inline", "after-waiting"])
async def test_a_failing_delivery_raises_as_faust_s_path_raises(waits: bool) -> None:
    consumer = Consumer()

    async def fail() -> None:
        if waits:
            await asyncio.sleep(0.01)
        raise KeyError("no callback for this partition")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError, match="no callback"):
            await consumer.deliver(fail())
        gc.collect()
    assert consumer.slow_path == int(waits)
