"""Which rollouts already have their answer on the bus: so work published by a service killed before it
committed is not done again.

A service that answers each message of a rollout-keyed topic with one message on another (the sandbox runner
answers a task with a diff, the gym runner with a reward) publishes the answer, then commits. Killed between
the two, it leaves the message uncommitted; done again, the rollout would be answered twice. Both topics are
co-partitioned (:mod:`~rollbus.kafka.topics`) and answers are keyed by rollout id, so the answers to one
partition's messages all lie in the answer topic's partition of the same number. Read to its end after that
partition was assigned, it holds every answer a previous owner published: that owner published before it died
or gave the partition up, so before the assignment.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from aiokafka import TopicPartition

from rollbus.kafka.read import read_partitions

log = logging.getLogger("rollbus.kafka")


class AnsweredRollouts:
    """The rollout ids answered on ``topic``, per partition number, read on first use after each assignment.

    ``assigned`` gives the partition numbers this member holds now: the first question about any of them
    reads all of them at once. :meth:`forget` on every assignment (a partition may have had another owner
    since it was read)."""

    def __init__(
        self, bootstrap_servers: str, topic: str, *, client_id: str, assigned: Callable[[], Iterable[int]]
    ) -> None:
        self.bootstrap_servers, self.topic, self.client_id = bootstrap_servers, topic, client_id
        self.assigned = assigned
        self._known: dict[int, set[str]] = {}
        self._generation = 0  # bumped by forget(): a read that spans an assignment is read again

    def forget(self) -> None:
        self._known.clear()
        self._generation += 1

    async def answered(self, partition: int, rollout_id: str | None) -> bool:
        """Whether ``rollout_id`` (a message of ``partition`` of the answered topic) has its answer."""
        while partition not in self._known:
            generation = self._generation
            wanted = {partition, *self.assigned()} - set(self._known)
            read = await self._read(wanted)
            if generation == self._generation:
                self._known.update(read)
        return rollout_id in self._known[partition]

    async def _read(self, partitions: set[int]) -> dict[int, set[str]]:
        found: dict[int, set[str]] = {p: set() for p in partitions}
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        async for record in read_partitions(self.bootstrap_servers, tps, client_id=self.client_id):
            if record.key is not None:
                found[record.partition].add(record.key.decode("utf-8", "replace"))
        log.info("%s: %d answered rollouts in partitions %s", self.topic,
                 sum(map(len, found.values())), sorted(partitions))  # fmt: skip
        return found
