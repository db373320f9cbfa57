"""The seek that follows a batch dropped in a rebalance, over the real broker and aiokafka's consumer.

Faust drops a batch cut short by a rebalance and counts on a seek to committed offsets to fetch it again.
aiokafka's ``seek_to_committed`` skips a partition never committed: without
:func:`~rollbus.services.segmenter.upstream_fixes.rewind_uncommitted_on_seek` the dropped messages of an input
were never read again, and without
:func:`~rollbus.services.segmenter.upstream_fixes.rewind_changelogs_on_seek` those of a table changelog under
recovery (which is never committed) were not either.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from rollbus.kafka import clients
from rollbus.services.segmenter.upstream_fixes import rewind_changelogs_on_seek, rewind_uncommitted_on_seek

pytestmark = pytest.mark.kafka


async def three_each(bootstrap: str, *tps: TopicPartition) -> None:
    producer = clients.producer(bootstrap, client_id="test-seek")
    await producer.start()
    try:
        for tp in tps:
            for n in range(3):
                await producer.send_and_wait(tp.topic, f"m{n}".encode(), key=b"k", partition=tp.partition)
    finally:
        await producer.stop()


def group_consumer(bootstrap: str) -> AIOKafkaConsumer:
    return clients.consumer(
        bootstrap, client_id="test-seek", consumer_group=f"seek-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
    )  # fmt: skip


async def test_a_seek_to_committed_offsets_reads_a_partition_never_committed_again_from_its_start(
    kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    fresh, committed, other = (
        TopicPartition(topics["rewards"], 0),
        TopicPartition(topics["rewards"], 1),
        TopicPartition(topics["diffs"], 0),
    )
    await three_each(kafka_bootstrap, fresh, committed, other)
    consumer = group_consumer(kafka_bootstrap)
    await consumer.start()
    try:
        consumer.assign([fresh, committed, other])
        await consumer.commit({committed: OffsetAndMetadata(2, "")})
        for tp in (fresh, committed, other):  # what a dropped batch leaves: positions past what was handled
            consumer.seek(tp, 3)

        await consumer.seek_to_committed()  # aiokafka alone: the partitions never committed stay at 3
        assert [await consumer.position(tp) for tp in (fresh, committed, other)] == [3, 2, 3]

        async def seek_wait(offsets: dict[TopicPartition, int]) -> None:  # Faust's, without its thread
            for tp, offset in offsets.items():
                consumer.seek(tp, offset)

        faust_consumer = SimpleNamespace(seek_to_committed=consumer.seek_to_committed, seek_wait=seek_wait)
        for tp in (fresh, committed, other):
            consumer.seek(tp, 3)
        rewind_uncommitted_on_seek(faust_consumer, [topics["rewards"]])
        returned = await faust_consumer.seek_to_committed()
        assert returned == {fresh: None, committed: 2, other: None}  # what Faust reads: still the committed
        # the rewards partition never committed starts again; the topic not handed to it is left alone
        assert [await consumer.position(tp) for tp in (fresh, committed, other)] == [0, 2, 3]
        fetched = await consumer.getmany(fresh, timeout_ms=5000)
        assert [record.value for record in fetched[fresh]] == [b"m0", b"m1", b"m2"]
    finally:
        await consumer.stop()


async def test_a_seek_to_committed_offsets_rewinds_changelogs_under_recovery_to_what_was_applied(
    kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    """Two changelog partitions under recovery (one active, record 0 and 1 applied; one standby, nothing
    applied) and a stream partition, all read past by a dropped batch: the stream goes back to its committed
    offset, each changelog to the last record its recovery applied (read again: applying is idempotent)."""
    active, standby, stream = (
        TopicPartition(topics["segments"], 0),
        TopicPartition(topics["segments"], 1),
        TopicPartition(topics["rewards"], 0),
    )
    await three_each(kafka_bootstrap, active, standby, stream)
    consumer = group_consumer(kafka_bootstrap)
    await consumer.start()
    try:
        consumer.assign([active, standby, stream])
        await consumer.commit({stream: OffsetAndMetadata(1, "")})

        async def seek_wait(offsets: dict[TopicPartition, int]) -> None:  # Faust's, without its thread
            for tp, offset in offsets.items():
                consumer.seek(tp, offset)

        async def perform_seek() -> None:  # what Faust's does to the positions
            await consumer.seek_to_committed()

        faust_consumer = SimpleNamespace(
            perform_seek=perform_seek, seek_wait=seek_wait, assignment=consumer.assignment
        )
        recovery = SimpleNamespace(
            active_tps={active},
            active_offsets={active: 1},
            standby_tps={standby},
            standby_offsets={standby: -1},
        )
        app = SimpleNamespace(consumer=faust_consumer, tables=SimpleNamespace(recovery=recovery))
        for tp in (active, standby, stream):
            consumer.seek(tp, 3)
        await faust_consumer.perform_seek()  # Faust alone: the changelogs stay past the dropped records
        assert [await consumer.position(tp) for tp in (active, standby, stream)] == [3, 3, 1]

        rewind_changelogs_on_seek(app)
        for tp in (active, standby, stream):
            consumer.seek(tp, 3)
        await faust_consumer.perform_seek()
        assert [await consumer.position(tp) for tp in (active, standby, stream)] == [1, 0, 1]
        fetched = await consumer.getmany(active, timeout_ms=5000)
        assert [record.value for record in fetched[active]] == [b"m1", b"m2"]
    finally:
        await consumer.stop()
