"""``rollbus.kafka.read.read_merged`` on the real broker: the order ``rollbus rebuild`` replays in."""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition

from rollbus.kafka import clients
from rollbus.kafka.read import read_merged

pytestmark = pytest.mark.kafka


async def test_partitions_merge_by_timestamp_each_keeping_its_own_order(kafka_bootstrap, topics):
    """Equal timestamps go to the partition listed first; a partition whose timestamps step back (a
    producer's clock, a retry) is still read in offset order; an empty partition ends nothing early."""
    first, second, empty = topics["turns"], topics["sessions"], topics["diffs"]
    writes = [(first, b"a10", 10), (first, b"a30", 30), (first, b"a30'", 30), (first, b"a50", 50)]
    writes += [(first, b"a20", 20), (second, b"b20", 20), (second, b"b30", 30), (second, b"b40", 40)]
    producer = clients.producer(kafka_bootstrap, client_id="test-read-merged")
    await producer.start()
    try:
        for topic, value, at in writes:
            await producer.send_and_wait(topic, value, partition=0, timestamp_ms=at)
    finally:
        await producer.stop()
    partitions = [TopicPartition(first, 0), TopicPartition(empty, 0), TopicPartition(second, 0)]
    read = [m.value async for m in read_merged(kafka_bootstrap, partitions, client_id="test-read-merged")]
    assert read == [b"a10", b"b20", b"a30", b"a30'", b"b30", b"b40", b"a50", b"a20"]
