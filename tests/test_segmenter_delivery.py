"""quick_delivery: Faust's per-message hand-over finished inline when it need not wait, Faust's own path
(cut short by a suspended flow) when it must; the same results, exceptions and cancellations either way.
handle_inline: the inputs go straight to the handler and are acked once handled, to its end whatever a
rebalance does meanwhile; not at all when the flow stopped first; other topics go to the conductor.
seek_before_streams_resume: the end of a recovery (the streams' seek) waits for a stopped flow and for the
hand-over under way to end. rewind_changelogs_on_seek: a seek to committed offsets also rewinds changelogs.
rewind_uncommitted_on_seek: ...and starts again input partitions never committed."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.errors import IllegalStateError
from faust.types import TP
from mode import Service
from mode.utils.locks import Event
from mode.utils.queues import FlowControlEvent

from services.segmenter.delivery import (
    handle_inline,
    quick_delivery,
    resume,
    rewind_changelogs_on_seek,
    rewind_uncommitted_on_seek,
    seek_before_streams_resume,
)


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
        self.idle = quick_delivery(self)
        self._unacked: set[object] = set()
        self.acked: list[object] = []

    def stop_flow(self) -> None:
        self.suspend_flow.set()

    # what handle_inline touches besides: the conductor's callback, the unacked set, ack
    async def callback(self, message: object) -> str:
        return f"conductor got {message.topic}"

    @property
    def unacked(self) -> set[object]:
        return self._unacked

    def ack(self, message: object) -> bool:
        self.acked.append(message)
        return True

    async def deliver(self, coro) -> object:
        """As Faust's fetcher does it (faust/transport/consumer.py ``_drain_messages``)."""
        return await self.wait_first(coro, self.suspend_flow.wait())


async def put_noting_cancellation(queue: asyncio.Queue, message: str, seen: list[object]) -> str:
    """A delivery onto ``queue`` that notes in ``seen`` a cancellation where it waited."""
    try:
        await queue.put(message)
    except asyncio.CancelledError:
        seen.append("cancelled")
        raise
    return message


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
    seen: list[object] = []
    asyncio.get_running_loop().call_later(0.05, consumer.suspend_flow.set)
    result = await consumer.deliver(put_noting_cancellation(queue, "m", seen))
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


async def test_the_streams_seek_waits_for_a_stopped_flow_and_the_hand_over_under_way_to_end() -> None:
    """Faust's end of recovery seeks the stream partitions with the flow on: a message handed over meanwhile
    was read past, then dropped with the queues. Patched, it runs only once the flow is stopped, the queues'
    flow control suspended, and a delivery stuck on a full queue cut short (so nothing lands after)."""
    consumer, queue, steps = Consumer(), asyncio.Queue(maxsize=1), []
    queue.put_nowait("full")

    class Recovery:
        async def on_recovery_completed(self, generation_id: int = 0) -> None:
            steps.append(("completed", generation_id, consumer.suspend_flow.is_set(),
                          app.flow_control.is_active(), consumer.idle.is_set()))  # fmt: skip

    app = SimpleNamespace(consumer=consumer, flow_control=FlowControlEvent(), tables=SimpleNamespace())
    app.tables.recovery = Recovery()
    seek_before_streams_resume(app, consumer.idle)

    delivery = asyncio.ensure_future(consumer.deliver(put_noting_cancellation(queue, "m", steps)))
    await asyncio.sleep(0.01)
    assert not consumer.idle.is_set()  # stuck on the full queue
    await app.tables.recovery.on_recovery_completed(7)
    await delivery
    assert steps == ["cancelled", ("completed", 7, True, False, True)]
    assert queue.qsize() == 1 and queue.get_nowait() == "full"


async def test_without_a_hand_over_under_way_the_streams_seek_follows_at_once() -> None:
    consumer, ran = Consumer(), []

    class Recovery:
        async def on_recovery_completed(self, generation_id: int = 0) -> None:
            ran.append(generation_id)

    app = SimpleNamespace(consumer=consumer, flow_control=FlowControlEvent(), tables=SimpleNamespace())
    app.tables.recovery = Recovery()
    seek_before_streams_resume(app, consumer.idle)
    await asyncio.wait_for(app.tables.recovery.on_recovery_completed(), timeout=1)
    assert ran == [0] and consumer.suspend_flow.is_set()


async def test_a_seek_to_committed_offsets_also_rewinds_changelogs_to_what_their_recovery_applied() -> None:
    """Faust drops a batch fetched as a rebalance stops the flow and seeks back to committed offsets, which
    changelog partitions have none of: they go back to the recovery's applied offsets (re-reading is
    idempotent), never -1, only where assigned, and a seek the assignment refused is left to the next
    recovery."""
    active, promoted, standby, gone = (TP("rollouts-changelog", p) for p in range(4))
    calls: list[object] = []

    class FakeConsumer:
        refuse = False

        async def perform_seek(self) -> None:
            calls.append("streams to committed")

        def assignment(self) -> set[TP]:
            return {active, promoted, standby}

        async def seek_wait(self, offsets: dict[TP, int]) -> None:
            if self.refuse:
                raise IllegalStateError("No current assignment for partition")
            calls.append(offsets)

    recovery = SimpleNamespace(
        active_tps={active, promoted, gone},
        active_offsets={active: 41, promoted: -1, gone: 7},
        standby_tps={standby},
        standby_offsets={standby: None},
    )
    consumer = FakeConsumer()
    rewind_changelogs_on_seek(SimpleNamespace(consumer=consumer, tables=SimpleNamespace(recovery=recovery)))
    await consumer.perform_seek()
    assert calls == ["streams to committed", {active: 41, promoted: 0, standby: 0}]
    consumer.refuse = True
    await consumer.perform_seek()
    assert calls[2:] == ["streams to committed"]


class Message(SimpleNamespace):
    tp = TP("ns.turns", 0)

    def __hash__(self) -> int:
        return id(self)


async def ebbed() -> None:
    return None


def inline_app(handle, ebb=ebbed) -> SimpleNamespace:
    """A Faust app as far as handle_inline reads it, its flow on (as after a recovery)."""
    app = SimpleNamespace(consumer=Consumer(), flow_control=FlowControlEvent(initially_suspended=False),
                          producer=SimpleNamespace(buffer=SimpleNamespace(wait_until_ebb=ebb)),
                          consumer_generation_id=3,
                          monitor=SimpleNamespace(stream_inbound_time={}))  # fmt: skip
    handle_inline(app, {"ns.turns"}, handle)
    return app


async def fetch(app: SimpleNamespace, message: Message) -> object:
    """What Faust's fetcher does with one message."""
    return await app.consumer.deliver(app.consumer.callback(message))


async def test_an_input_is_handled_inline_and_acked_and_other_topics_go_to_the_conductor() -> None:
    handled: list[object] = []

    async def handle(message: Message) -> None:
        assert message in app.consumer.unacked  # a rebalance would wait for it
        handled.append(message)

    app = inline_app(handle)
    turn = Message(topic="ns.turns", tp=TP("ns.turns", 4))
    changelog = Message(topic="ns-rollouts-changelog", tp=TP("ns-rollouts-changelog", 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (await fetch(app, turn)).results == [None]
        assert (await fetch(app, changelog)).results == ["conductor got ns-rollouts-changelog"]
        gc.collect()
    assert handled == [turn] and app.consumer.acked == [turn] and not app.consumer.unacked
    assert app.consumer.slow_path == 0
    # Faust's liveness check sees the partition's stream taking messages in (it would log an error)
    assert set(app.monitor.stream_inbound_time) == {TP("ns.turns", 4)}


async def test_a_rebalance_waits_for_the_message_under_way_which_is_handled_to_its_end_and_acked() -> None:
    """Faust's path would cancel a delivery when the flow stops; a handler cut short after sending
    segments but before settling would leave its message for a rebalance to wait on forever."""
    acks: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def handle(message: Message) -> None:
        steps.append("sent")
        await acks  # the segments' acks
        steps.append("settled")

    app = inline_app(handle)
    turn = Message(topic="ns.turns")
    delivery = asyncio.ensure_future(fetch(app, turn))
    await asyncio.sleep(0.01)
    app.consumer.stop_flow()  # a rebalance begins
    app.flow_control.suspend()
    await asyncio.sleep(0.01)
    assert steps == ["sent"] and not delivery.done() and turn in app.consumer.unacked
    acks.set_result(None)
    assert (await delivery).results == [None]
    assert steps == ["sent", "settled"] and app.consumer.acked == [turn] and not app.consumer.unacked


@pytest.mark.parametrize("stopped", ["suspend_flow", "flow_control", "generation"])
async def test_an_input_fetched_as_the_flow_stops_is_neither_handled_nor_acked(stopped: str) -> None:
    """It is fetched again after the seek to committed offsets that ends the rebalance."""
    handled: list[object] = []

    async def handle(message: Message) -> None:
        handled.append(message)

    ebb: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def ebbing() -> None:  # the producer's buffer is full: the hand-over waits for it to ebb
        await ebb

    app = inline_app(handle, ebbing)
    delivery = asyncio.ensure_future(fetch(app, Message(topic="ns.turns")))
    await asyncio.sleep(0.01)
    if stopped == "suspend_flow":
        app.consumer.stop_flow()
    elif stopped == "flow_control":
        app.flow_control.suspend()
    else:
        app.consumer_generation_id += 1  # a whole rebalance went by while it waited
    ebb.set_result(None)
    await delivery
    assert handled == [] and app.consumer.acked == [] and not app.consumer.unacked


@pytest.mark.parametrize("how", ["raises", "cancelled"])
async def test_a_handler_that_fails_or_is_cancelled_leaves_its_message_unacked(how: str) -> None:
    """A bus failure (raises) stops the worker; a stopping fetcher cancels the handler: the message is not
    committed either way, and nothing waits for it."""
    started = asyncio.Event()

    async def handle(message: Message) -> None:
        started.set()
        await asyncio.sleep(0.01)
        if how == "raises":
            raise ConnectionError("the broker went away")
        await asyncio.sleep(10)

    app = inline_app(handle)
    delivery = asyncio.ensure_future(fetch(app, Message(topic="ns.turns")))
    if how == "raises":
        with pytest.raises(ConnectionError):
            await delivery
    else:
        await started.wait()
        delivery.cancel()
        with pytest.raises(asyncio.CancelledError):
            await delivery
    assert app.consumer.acked == [] and not app.consumer.unacked


async def test_a_partition_the_assignment_no_longer_has_is_left_to_the_next_recovery() -> None:
    """The beginning seek of a partition never committed, refused because a rebalance took it meanwhile,
    neither fails the seek to committed offsets nor changes what it returns."""
    fresh, done = TP("turns", 0), TP("turns", 1)

    class RevokedConsumer:
        async def seek_to_committed(self) -> dict[TP, int | None]:
            return {fresh: None, done: 5}

        async def seek_wait(self, offsets: dict[TP, int]) -> None:
            assert offsets == {fresh: 0}
            raise IllegalStateError("No current assignment for partition")

    consumer = RevokedConsumer()
    rewind_uncommitted_on_seek(consumer, ["turns"])
    assert await consumer.seek_to_committed() == {fresh: None, done: 5}


@pytest.mark.parametrize("outcome", ["result", "error"])
async def test_a_cancellation_after_the_awaited_future_is_done_reaches_the_delivery_as_under_a_task(
    outcome: str,
) -> None:
    """The future a delivery awaits is done, and the task driving it is cancelled before it wakes: asyncio's
    task throws the cancellation into the coroutine; ``resume`` must too, not resume it as if nothing came."""

    async def run(drive: Callable[[Coroutine[Any, Any, None]], Coroutine[Any, Any, None]]) -> list[str]:
        seen: list[str] = []
        future = asyncio.get_running_loop().create_future()

        async def delivery() -> None:
            try:
                await future
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            except RuntimeError:
                seen.append("error")
                return
            seen.append("resumed")

        task = asyncio.create_task(drive(delivery()))
        await asyncio.sleep(0)  # the delivery now awaits the future
        if outcome == "result":
            future.set_result(1)
        else:
            future.set_exception(RuntimeError("the future's own failure"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    async def as_a_task(coro: Coroutine[Any, Any, None]) -> None:
        await coro

    async def through_resume(coro: Coroutine[Any, Any, None]) -> None:
        await resume(coro, coro.send(None))

    assert await run(as_a_task) == ["cancelled"]
    assert await run(through_resume) == ["cancelled"]
