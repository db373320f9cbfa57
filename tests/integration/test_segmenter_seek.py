"""The seek that follows a batch dropped in a rebalance, over the real broker and aiokafka's consumer.

Faust drops a batch cut short by a rebalance and counts on a seek to committed offsets to fetch it again.
aiokafka's ``seek_to_committed`` skips a partition never committed: without
:func:`~services.segmenter.delivery.rewind_uncommitted_on_seek` the dropped messages were never read again.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from services.segmenter.delivery import rewind_uncommitted_on_seek

pytestmark = pytest.mark.kafka


async def test_a_seek_to_committed_offsets_reads_a_partition_never_committed_again_from_its_start(
    kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    fresh, committed, other = (
        TopicPartition(topics["rewards"], 0),
        TopicPartition(topics["rewards"], 1),
        TopicPartition(topics["diffs"], 0),
    )
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        for tp in (fresh, committed, other):
            for n in range(3):
                await producer.send_and_wait(tp.topic, f"m{n}".encode(), key=b"k", partition=tp.partition)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=f"seek-{uuid.uuid4().hex[:8]}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
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
