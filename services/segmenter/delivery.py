"""How Faust's fetcher hands each message over: the segmenter's inputs straight to their handler, the rest
(table changelogs) to Faust's conductor, without four tasks per message.

Why: Faust delivers every fetched message through ``await self.wait_first(callback(message),
self.suspend_flow.wait())`` (faust/transport/consumer.py ``_drain_messages``). ``wait_first`` wraps each
argument, plus the consumer's stopped and crashed events, in a task and waits on all four; the callback (the
conductor) builds an event and puts it on an agent's queue, and the agent's stream takes it off, runs
sensors and acks it. The segmenter has one sequential handler of every input: a no-op worker took 130-140
µs of CPU an event that way, 80-90 µs with each input handed straight to it (measured on this machine).
:func:`handle_inline` gives the inputs to the handler in the fetcher's own hand-over, and
:func:`quick_delivery` runs every hand-over inline until it has to wait: a conductor's delivery (a full
queue, a locked conductor) then takes Faust's own path, cut short by a rebalance exactly as before; a
handler's runs to its end, as Faust waits for an agent's event under way.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import IllegalStateError
from mode.services import WaitResults


@dataclass
class _Inline:
    """What a hand-over to the handler reads of the app, looked up once."""

    handle: Callable[[Any], Awaitable[None]]
    consumer: Any
    flow_control: Any
    producer_ebb: Callable[[], Awaitable[None]]
    app: Any


async def _hand_over(inline: _Inline, message: Any) -> None:
    """Handle ``message`` and ack it, unless a rebalance stopped the flow first (Faust's conductor waits
    for it to resume and is cut short by the rebalance): then it stays unacked, and the seek to committed
    offsets that ends every rebalance fetches it again, for whichever worker owns its partition by then."""
    generation = inline.app.consumer_generation_id
    await inline.producer_ebb()  # the conductor's back pressure: the producer's buffer ebbs first
    if (
        inline.consumer.suspend_flow.is_set()
        or not inline.flow_control.is_active()
        or inline.app.consumer_generation_id != generation
    ):
        return
    unacked = inline.consumer.unacked  # what a rebalance waits for (``wait_empty``) before it commits
    unacked.add(message)
    # what a stream's sensor would note: Faust's liveness check logs an error for a partition with lag
    # whose stream has taken nothing in for --stream-processing-timeout (5 min), handled or not
    inline.app.monitor.stream_inbound_time[message.tp] = time.monotonic()
    try:
        await inline.handle(message)
    except BaseException:
        unacked.discard(message)  # never acked, so never committed: nothing need wait for it
        raise
    inline.consumer.ack(message)
    unacked.discard(message)  # ack leaves it there when its offset is below the committed one (a replay)


_HAND_OVER = _hand_over.__code__


def handle_inline(app: Any, topics: Collection[str], handle: Callable[[Any], Awaitable[None]]) -> None:
    """Make ``app``'s fetcher give each message of ``topics`` to ``handle`` and ack it once handled; other
    topics' messages (table changelogs) still go to Faust's conductor.

    ``handle`` runs in the fetcher's task, one message at a time, so it is the only writer of the tables, as
    an agent of concurrency 1 would be. A rebalance waits for the message under way (it is in the consumer's
    unacked set), and a handler that raises leaves its message unacked (uncommitted) and stops the fetcher.
    The topics must still be subscribed (``app.topics.add``); no stream reads them.
    """
    consumer = app.consumer
    conductor = consumer.callback
    inline = _Inline(handle, consumer, app.flow_control, app.producer.buffer.wait_until_ebb, app)
    topics = frozenset(topics)

    def route(message: Any) -> Coroutine[Any, Any, None]:
        return _hand_over(inline, message) if message.topic in topics else conductor(message)

    consumer.callback = route  # read when the fetcher starts draining


def quick_delivery(consumer: Any) -> asyncio.Event:
    """Give ``consumer`` (a Faust consumer) a ``wait_first`` that finishes a delivery inline when it can,
    and a hand-over to the handler (:func:`handle_inline`) always to its end; the returned event is set while
    no delivery is under way."""
    original = consumer.wait_first
    suspend_flow = consumer.suspend_flow
    idle = asyncio.Event()
    idle.set()

    async def wait_first(*coros: Any, timeout: float | None = None) -> WaitResults:
        idle.clear()
        try:
            # a hand-over to the handler checks the flow itself and is never cut short by it
            own = len(coros) == 2 and getattr(coros[0], "cr_code", None) is _HAND_OVER
            if not own and (len(coros) != 2 or suspend_flow.is_set() or not inspect.iscoroutine(coros[0])):
                return await original(*coros, timeout=timeout)
            delivery, suspended = coros
            try:
                yielded = delivery.send(None)
            except BaseException as finished:
                _close(suspended)
                if isinstance(finished, StopIteration):
                    return WaitResults([delivery], [finished.value], False)
                raise
            if own:  # to its end, whatever the flow does meanwhile
                _close(suspended)
                return WaitResults([delivery], [await resume(delivery, yielded)], False)
            return await original(resume(delivery, yielded), suspended, timeout=timeout)
        finally:
            idle.set()

    consumer.wait_first = wait_first
    return idle


def _close(suspended: Any) -> None:
    if inspect.iscoroutine(suspended):
        suspended.close()  # never started: nothing to cancel


def batched_fetches(consumer: Any, min_bytes: int, max_wait: float) -> None:
    """Make the aiokafka consumer that ``consumer`` (a Faust consumer) creates wait, per fetch, for
    ``min_bytes`` or ``max_wait`` seconds, whichever comes first.

    Why: Faust builds its consumer with aiokafka's default of one byte (faust/transport/drivers/aiokafka.py
    ``_create_worker_consumer`` offers no setting), so under a steady trickle of events every fetch comes
    back with one or two messages and the next is sent at once. On this machine those round trips, across
    Faust's consumer thread, were ~40% of a no-op agent's CPU: 221 -> 135 µs of worker CPU per event with
    256 KiB / 100 ms (a no-op agent fed ``bench/pipeline.py``'s rollouts at 48/s). The price is up to
    ``max_wait`` of latency when less than ``min_bytes`` is waiting.
    """
    thread = consumer._thread
    create = thread._create_worker_consumer

    def create_batching(transport: Any) -> Any:
        created = create(transport)
        created._fetch_min_bytes = min_bytes  # read when start() builds the fetcher
        created._fetch_max_wait_ms = int(max_wait * 1000)
        return created

    thread._create_worker_consumer = create_batching


def seek_before_streams_resume(app: Any, delivery_idle: asyncio.Event) -> None:
    """Stop the flow of messages while Faust resumes the stream partitions after a recovery and seeks them
    to their committed offsets.

    Why: Faust's ``Recovery.on_recovery_completed`` (faust/tables/recovery.py) resumes the stream partitions,
    awaits the seek, and only then calls ``flow_control.resume()``, which empties every stream's queue. The
    flow is already on (the changelog reading turned it on), so what the fetcher hands over during that
    await is read past (the consumer's positions and read offsets move beyond it) and then thrown away
    unprocessed: nothing fetches it again until the next rebalance, and the commit goes past it once later
    offsets are acked. Measured here: a worker taking partitions over lost two of seven rewards that way,
    and their rollouts never closed. With the flow stopped first (as a rebalance stops it) and the message
    being handed over, if any, finished (so its read offset cannot overwrite the seek's), the seek is the
    last word on every position, and the resumed flow fetches everything from the committed offsets on.
    """
    recovery = app.tables.recovery
    completed = recovery.on_recovery_completed

    async def on_recovery_completed(generation_id: int = 0) -> None:
        app.consumer.stop_flow()
        app.flow_control.suspend()
        await delivery_idle.wait()
        await completed(generation_id)

    recovery.on_recovery_completed = on_recovery_completed


async def resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Drive ``coro``, which already yielded ``yielded``, to its end as the task running it would have: wait
    for each future it yields (cleared of its blocking mark first, as a task does), then resume it so it
    reads the future's outcome itself; a bare yield is one turn of the loop. A cancellation of this task is
    thrown into ``coro`` unless it cancelled the awaited future, which ``coro`` then reads: also when it came
    after the future was done (a task cancelled with its wake-up pending), where a task throws it in too."""
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
            except asyncio.CancelledError:  # the future's, read by ``coro``; or this task's, thrown in
                cancelled = not yielded.cancelled()
            except Exception:  # the future's outcome, read again by ``coro`` (KeyboardInterrupt propagates)
                pass
        else:
            raise RuntimeError(f"a delivery yielded {yielded!r}, which is not a future")
        try:
            yielded = coro.throw(asyncio.CancelledError()) if cancelled else coro.send(None)
        except StopIteration as done:
            return done.value


def rewind_changelogs_on_seek(app: Any) -> None:
    """Make every seek of the stream partitions to their committed offsets also seek the table changelog
    partitions under recovery (active or standby) back to what the recovery has applied.

    Why: when a fetch comes back while the flow is stopped (a rebalance began while the fetcher waited),
    Faust drops the whole batch, though the consumer's positions are already past it, and seeks back to the
    committed offsets (faust/transport/consumer.py ``getmany``). Changelog partitions have no committed
    offset, so that seek leaves them where they were: the dropped records are never read. Seen here: a
    worker promoted a changelog partition from standby to active, the recovery's seek to 0 and a fetch from
    0 raced the flow's resumption, the batch was dropped, and the recovery waited forever ("No event
    received for active tp ... since recovery start"). Seeking a changelog partition back to the last
    offset its recovery applied (as the recovery itself seeks) can only make it read records again, which
    applying is idempotent to.
    """
    consumer, recovery = app.consumer, app.tables.recovery
    seek = consumer.perform_seek

    async def perform_seek() -> None:
        await seek()
        assigned = consumer.assignment()
        applied = {
            tp: max(offsets.get(tp) or 0, 0)
            for tps, offsets in (
                (recovery.standby_tps, recovery.standby_offsets),
                (recovery.active_tps, recovery.active_offsets),
            )
            for tp in tps
            if tp in assigned
        }
        if applied:
            try:
                await consumer.seek_wait(applied)
            except IllegalStateError:  # the assignment changed meanwhile: the next recovery seeks anew
                pass

    consumer.perform_seek = perform_seek


def rewind_uncommitted_on_seek(consumer: Any, topics: Collection[str]) -> None:
    """Make every seek of the stream partitions to their committed offsets seek the partitions of
    ``topics`` that have none (or 0) to their beginning, where the consumer's ``earliest`` reset starts them.

    Why: aiokafka's ``seek_to_committed`` seeks only partitions whose committed offset is above 0 and leaves
    the others where the fetcher had got to. Faust relies on that seek to fetch again what a rebalance made
    it drop (a batch cut short as the flow stopped, or fetched while it was stopped: faust/transport/
    consumer.py ``getmany``). On a partition never committed yet, the dropped messages were never read
    again: seen here, a worker that took a fresh ``rewards`` partition over lost its first two rewards
    that way, and their rollouts never closed. Reading a partition again from its start can only hand
    over messages again, which the segmenter deduplicates.
    """
    topics = frozenset(topics)
    seek_to_committed = consumer.seek_to_committed

    async def seek_to_committed_or_beginning() -> Mapping[Any, int | None]:
        committed = await seek_to_committed()
        skipped = {tp for tp, offset in committed.items() if not (offset and offset > 0)}  # what it skipped
        uncommitted = {tp: 0 for tp in skipped if tp.topic in topics}
        if uncommitted:
            try:
                await consumer.seek_wait(uncommitted)
            except IllegalStateError:  # the assignment changed meanwhile: the next recovery seeks anew
                pass
        return committed

    consumer.seek_to_committed = seek_to_committed_or_beginning
