"""Which diff is its rollout's first: the grader rewards only that one.

A rollout has one task, and a runner answers a task with one diff: it skips tasks already answered on `diffs`
(:mod:`rollbus.kafka.answered`). A runner that lost a task's partition while still alive (paused past its
session timeout) could still publish a second diff after the new owner read `diffs`; rewarding only a
rollout's first diff keeps one rewarded attempt per rollout even then (the later attempt gets no reward, so it
never trains). Diffs are keyed by rollout id, so all of a rollout's lie in one partition and "first" is the
lowest offset. Each partition is read by key only (no patch is decoded), from where the last read ended to the
end, whenever a diff past that is graded: once from the beginning at start, then only what is new.
"""

from __future__ import annotations

from aiokafka import TopicPartition

from rollbus.kafka import clients
from rollbus.kafka.read import read_to_end


class FirstDiffs:
    """Per partition of ``topic``: each key's first offset, read up to ``read_to``."""

    def __init__(self, bootstrap_servers: str, topic: str, *, client_id: str) -> None:
        self.bootstrap_servers, self.topic, self.client_id = bootstrap_servers, topic, client_id
        self._first: dict[int, dict[bytes, int]] = {}
        self._read_to: dict[int, int] = {}

    async def is_first(self, partition: int, offset: int, key: bytes | None) -> bool:
        """Whether the diff at ``offset`` of ``partition`` is the first one keyed ``key`` (no key: it is)."""
        if key is None:
            return True
        if offset >= self._read_to.get(partition, 0):
            await self._read(partition)
        return self._first.get(partition, {}).get(key, offset) == offset

    async def _read(self, partition: int) -> None:
        tp = TopicPartition(self.topic, partition)
        first = self._first.setdefault(partition, {})
        async with clients.started_consumer(
            self.bootstrap_servers, client_id=self.client_id, isolation_level="read_committed"
        ) as consumer:
            consumer.assign([tp])
            start = max(self._read_to.get(partition, 0), (await consumer.beginning_offsets([tp]))[tp])
            consumer.seek(tp, start)
            read_to = start
            async for record in read_to_end(consumer, [tp]):
                if record.key is not None:
                    first.setdefault(record.key, record.offset)
                read_to = record.offset + 1
        self._read_to[partition] = max(read_to, self._read_to.get(partition, 0))
