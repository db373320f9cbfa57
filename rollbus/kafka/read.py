"""Reading partitions from their beginning to their end as of the start of the read.

For everything that derives state from the log once rather than following it: ``rollbus rebuild`` (its
partitions merged by timestamp, :func:`read_merged`), the trainer's latest policy version, ``rollbus replay``
without ``--follow``. Offsets are set explicitly:
``seek_to_beginning()`` right after ``assign()`` races the consumer's own offset reset and can leave the
position at the end, which would read as an empty topic.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from rollbus.kafka import clients


async def from_beginning(consumer: AIOKafkaConsumer, partitions: Sequence[TopicPartition]) -> None:
    """Assign ``partitions`` to the (group-less, started) consumer, each at its first offset."""
    consumer.assign(list(partitions))
    for tp, offset in (await consumer.beginning_offsets(list(partitions))).items():
        consumer.seek(tp, offset)


async def behind(consumer: AIOKafkaConsumer, ends: Mapping[TopicPartition, int]) -> bool:
    """Whether any partition's position is still before its end in ``ends``."""
    for tp, end in ends.items():
        if await consumer.position(tp) < end:
            return True
    return False


async def read_to_end(
    consumer: AIOKafkaConsumer, partitions: Sequence[TopicPartition]
) -> AsyncIterator[ConsumerRecord]:
    """Every message of the assigned ``partitions`` from their positions to their ends as of now, in order
    within each partition; messages written meanwhile are not read."""
    ends = await consumer.end_offsets(list(partitions))
    while await behind(consumer, ends):
        for tp, records in (await consumer.getmany(*partitions, timeout_ms=500)).items():
            for record in records:
                if record.offset < ends[tp]:
                    yield record


async def read_partitions(
    bootstrap_servers: str, partitions: Sequence[TopicPartition], *, client_id: str, **options: Any
) -> AsyncIterator[ConsumerRecord]:
    """Every committed message of ``partitions`` up to their ends as of now (:func:`read_to_end` from the
    beginning, on a consumer of its own); ``options`` are the consumer's."""
    options.setdefault("isolation_level", "read_committed")
    async with clients.started_consumer(bootstrap_servers, client_id=client_id, **options) as consumer:
        await from_beginning(consumer, partitions)
        async for record in read_to_end(consumer, partitions):
            yield record


async def read_merged(
    bootstrap_servers: str, partitions: Sequence[TopicPartition], *, client_id: str, **options: Any
) -> AsyncIterator[ConsumerRecord]:
    """Every committed message of ``partitions`` up to their ends as of now, merged into one stream by
    broker timestamp, each partition's own order kept (equal timestamps: the partition listed first).

    Streams: at most one fetch per partition is held, so a log of any size is read in bounded memory.
    ``options`` are the consumer's."""
    options.setdefault("isolation_level", "read_committed")
    async with clients.started_consumer(bootstrap_servers, client_id=client_id, **options) as consumer:
        await from_beginning(consumer, partitions)
        ends = await consumer.end_offsets(list(partitions))
        fetched: dict[TopicPartition, deque[ConsumerRecord]] = {tp: deque() for tp in partitions}

        async def next_of(tp: TopicPartition) -> ConsumerRecord | None:
            waiting = fetched[tp]
            while not waiting:
                if await consumer.position(tp) >= ends[tp]:
                    return None
                batch = await consumer.getmany(tp, timeout_ms=500)
                waiting.extend(r for r in batch.get(tp, ()) if r.offset < ends[tp])
            return waiting.popleft()

        heads: list[tuple[int, int, ConsumerRecord]] = []
        for index, tp in enumerate(partitions):
            if (record := await next_of(tp)) is not None:
                heads.append((record.timestamp, index, record))
        heapq.heapify(heads)
        while heads:
            _, index, record = heapq.heappop(heads)
            yield record
            if (record := await next_of(partitions[index])) is not None:
                heapq.heappush(heads, (record.timestamp, index, record))
