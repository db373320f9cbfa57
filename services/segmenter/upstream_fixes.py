"""Fixes of Faust and aiokafka defects that lose data, proven against one set of versions, and nothing else.

Each fix replaces one method on one instance of the running app, names the upstream code it corrects, and has
a test over the real broker (tests/integration/test_segmenter_upstream_fixes.py, test_segmenter_seek.py).
They depend on those libraries' internals, so :func:`check_versions` refuses to start with any other
versions than :data:`PROVEN`: an upgrade must rerun those tests (and the segmenter's integration tests,
rebalance ones several times) and then move the pins here and in pyproject.toml together.

What is replaced (instance attributes only; no private attribute is read or written anywhere):

* ``app.producer.flush`` and each table's ``send_changelog``: :func:`commit_after_changelogs`;
* each table's ``partition_for_key``: :func:`log_to_the_event_s_partition`;
* ``app.consumer.wait_first`` (wrapped, only counted) and ``app.tables.recovery.on_recovery_completed``:
  :func:`seek_before_streams_resume`;
* ``app.consumer.perform_seek``: :func:`rewind_changelogs_on_seek`;
* ``app.consumer.seek_to_committed``: :func:`rewind_uncommitted_on_seek`.

Read besides: ``app.tables.recovery``'s ``active_tps``, ``active_offsets``, ``standby_tps``,
``standby_offsets``, and the consumer's ``stop_flow``, ``seek_wait`` and ``assignment``. Private attributes
appear only in tests, to stage a defect: ``ProducerBuffer._send_pending`` (slowed) and
``faust.streams._current_event`` (an event set as a stream sets it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterable, Mapping
from importlib import metadata
from typing import Any

from aiokafka.errors import IllegalStateError

PROVEN = {"faust-streaming": "0.15.3", "aiokafka": "0.14.0", "mode-streaming": "0.7.1"}


class UnprovenUpstream(RuntimeError):
    """The installed Faust, aiokafka or mode is not the version these fixes were proven against."""


def check_versions(installed: Callable[[str], str] = metadata.version) -> None:
    """Raise :class:`UnprovenUpstream` naming every distribution whose installed version differs from
    :data:`PROVEN` (or that is missing)."""
    wrong = []
    for name, proven in PROVEN.items():
        try:
            found = installed(name)
        except metadata.PackageNotFoundError:
            found = "not installed"
        if found != proven:
            wrong.append(f"{name} {found} (proven: {proven})")
    if wrong:
        raise UnprovenUpstream(
            "the segmenter's fixes of Faust/aiokafka defects (services/segmenter/upstream_fixes.py) were "
            f"proven against other versions: {', '.join(wrong)}; install the proven versions, or rerun their "
            "tests against these and update PROVEN"
        )


def install(app: Any, tables: Iterable[Any], inputs: Collection[str], changelog_timeout: float) -> None:
    """Check the versions, then apply every fix to ``app`` (a Faust app not started yet), whose streams
    read the topics ``inputs`` and whose ``tables`` must never lose a committed change."""
    check_versions()
    tables = tuple(tables)
    log_to_the_event_s_partition(tables)
    commit_after_changelogs(app, tables, changelog_timeout)
    seek_before_streams_resume(app)
    rewind_changelogs_on_seek(app)
    rewind_uncommitted_on_seek(app.consumer, inputs)


def log_to_the_event_s_partition(tables: Iterable[Any]) -> None:
    """Make each table log a change to the partition of the event being handled, as Faust does, without
    Faust's check of the changelog's partition count on the first write from each source topic.

    Defect: ``Collection._verify_source_topic_partitions`` (faust/tables/base.py) reads the count from the
    consumer's metadata, which can hold a just-created changelog topic with no partitions for minutes; it
    then raises ``PartitionsMismatch`` ("has 0 partitions") on every write from that topic. Seen in
    ``bench/pipeline.py``: every turn of a fresh namespace failed for the whole run. ``rollbus segmenter``
    checks the counts itself before it starts (``main.preflight``), and Faust creates a missing changelog
    with the inputs' count.
    """
    from faust.streams import current_event

    def event_partition(key: Any) -> int:
        event = current_event()
        if event is None:
            raise TypeError("a table can only change while an event is handled")
        return event.message.partition

    for table in tables:
        table.partition_for_key = event_partition


def commit_after_changelogs(app: Any, tables: Iterable[Any], timeout: float) -> None:
    """Make the flush that precedes every offset commit wait for the broker's ack of every change made to
    ``tables`` so far, and for nothing else.

    Defect: ``ProducerBuffer.flush`` (faust/transport/producer.py) gives up when a queued message takes over
    0.1 s to be handed to aiokafka, and ``Consumer._commit_offsets`` (faust/transport/consumer.py) commits
    the offsets anyway. A table change still queued at a ``kill -9`` is lost while the event that made it
    counts as processed: its rollout never closes. The changes' own futures (resolved by the ack, failed by
    a send error) are awaited instead; one that fails or outlasts ``timeout`` fails the commit, and the
    worker stops uncommitted. Faust's flush is not called: it waits for the buffer message by message (a
    timer each), a tenth of the worker's CPU here, and the app's other sends are awaited where they are made.
    """
    pending: set[asyncio.Future[Any]] = set()
    for table in tables:
        send = table.send_changelog

        def tracked(*args: Any, _send: Any = send, **kwargs: Any) -> Any:
            written = _send(*args, **kwargs)
            pending.add(written)
            written.add_done_callback(pending.discard)
            return written

        table.send_changelog = tracked

    async def wait_for_changelogs() -> None:
        if pending:
            await asyncio.wait_for(asyncio.gather(*pending), timeout)

    app.producer.flush = wait_for_changelogs


def seek_before_streams_resume(app: Any) -> None:
    """Stop the flow of messages, and let the message being handed over settle, before Faust resumes the
    stream partitions at the end of a recovery and seeks them to their committed offsets.

    Defect: ``Recovery.on_recovery_completed`` (faust/tables/recovery.py) resumes the stream partitions and
    awaits the seek with the consumer's flow on (reading the changelogs turned it on), and only then calls
    ``flow_control.resume()``, which empties every stream's queue. What the fetcher hands over during that
    await is read past and thrown away unprocessed: a worker taking partitions over lost two of seven rewards
    that way, and their rollouts never closed. With the flow stopped first (as a rebalance stops it) and no
    hand-over under way (its read offset, set when it returns, would overwrite the seek's), the seek is the
    last word on every position.
    """
    consumer, recovery = app.consumer, app.tables.recovery
    wait_first = consumer.wait_first  # the fetcher's hand-over of each message (faust _drain_messages)
    under_way = 0
    idle = asyncio.Event()
    idle.set()

    async def counted_wait_first(*coros: Any, timeout: Any = None) -> Any:
        nonlocal under_way
        under_way += 1
        idle.clear()
        try:
            return await wait_first(*coros, timeout=timeout)
        finally:
            under_way -= 1
            if not under_way:
                idle.set()

    consumer.wait_first = counted_wait_first
    completed = recovery.on_recovery_completed

    async def on_recovery_completed(generation_id: int = 0) -> None:
        consumer.stop_flow()
        app.flow_control.suspend()
        await idle.wait()
        await completed(generation_id)

    recovery.on_recovery_completed = on_recovery_completed


def rewind_changelogs_on_seek(app: Any) -> None:
    """Make every seek of the stream partitions to their committed offsets also seek the table changelog
    partitions under recovery (active or standby) back to what the recovery has applied.

    Defect: when a fetch comes back while the flow is stopped (a rebalance began while the fetcher waited),
    ``Consumer.getmany`` (faust/transport/consumer.py) drops the whole batch, though the positions are past
    it, and calls ``perform_seek`` to go back to the committed offsets. Changelog partitions have no committed
    offset, so they stay where they were: a standby promoted to active whose records were in that batch
    waited forever ("No event received for active tp ... since recovery start"). Reading changelog records
    again is harmless: applying them is idempotent.
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
    """Make every seek to committed offsets also seek the partitions of ``topics`` that have none (or 0) to
    their beginning, where the consumer's ``earliest`` reset starts them.

    Defect: aiokafka's ``AIOKafkaConsumer.seek_to_committed`` seeks only partitions whose committed offset
    is above 0 and leaves the others where the fetcher had got to, and Faust relies on that seek to fetch
    again what a rebalance made it drop (``Consumer.getmany``). On a partition never committed, the dropped
    messages were never read again: a worker that took a fresh ``rewards`` partition over lost its first two
    rewards, and their rollouts never closed. Reading a partition again from its start only hands messages
    over again, which the segmenter deduplicates.
    """
    topics = frozenset(topics)
    seek_to_committed = consumer.seek_to_committed

    async def seek_to_committed_or_beginning() -> Mapping[Any, int | None]:
        committed = await seek_to_committed()
        skipped = {tp for tp, offset in committed.items() if not (offset and offset > 0)}  # aiokafka's test
        uncommitted = {tp: 0 for tp in skipped if tp.topic in topics}
        if uncommitted:
            try:
                await consumer.seek_wait(uncommitted)
            except IllegalStateError:  # the assignment changed meanwhile: the next recovery seeks anew
                pass
        return committed

    consumer.seek_to_committed = seek_to_committed_or_beginning
