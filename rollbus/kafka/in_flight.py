"""The consumer loop of services whose work outlives many polls (a rollout, a gym episode: minutes).

The loop never blocks on the work: it keeps polling (so the group keeps this member), pauses every
partition while ``capacity`` pieces of work run, and commits each partition only up to its oldest message
whose work is unfinished (:mod:`rollbus.kafka.watermark`). Work ends by returning once its results are
published; killed or cancelled first, its message stays uncommitted and the group hands it to another
member (or to this one restarted), which does it again, unless its answer is already on the bus (given
``answers``, :mod:`rollbus.kafka.answered`): killed after publishing its answer but before committing, the
work is not done again, its message is committed. Poison messages go to dead-letters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from rollbus.kafka import clients
from rollbus.kafka.answered import AnsweredRollouts
from rollbus.kafka.bus import Event, Publisher, decode_message
from rollbus.kafka.dead_letters import DeadLetters
from rollbus.kafka.topics import MAX_EVENT_BYTES
from rollbus.kafka.watermark import OffsetTracker

log = logging.getLogger("rollbus.kafka")
Work = Coroutine[Any, Any, Any]
Start = Callable[[Event], Work | None]  # None: nothing to do for this event (it is done at once)
ANSWERS_RETRY_S = 1.0


class _Rebalance(ConsumerRebalanceListener):
    """Commit what is done before partitions go; forget and cancel what did not come back."""

    def __init__(self, loop: InFlightConsumer) -> None:
        self.loop = loop

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.loop.commit(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.loop.reassigned(assigned)


class InFlightConsumer:
    """Runs ``start(event)``'s work for each message of ``topic``; see the module docstring.

    Work raising (anything but a cancellation) stops the loop: :meth:`run` raises it, and its message
    stays uncommitted. The caller owns ``publisher`` (dead letters go through it)."""

    def __init__(
        self, bootstrap_servers: str, topic: str, *, consumer_group: str, client_id: str, service: str,
        publisher: Publisher, start: Start, capacity: int, poll_ms: int = 500, answers: str | None = None,
        **options: Any,
    ) -> None:  # fmt: skip
        """``service`` names this service in dead letters; ``answers`` is the topic (co-partitioned with
        ``topic``, keyed by rollout id) the work publishes its one answer per rollout on, None: no check;
        ``options`` are the consumer's (aiokafka's)."""
        self.topic, self.service, self.publisher = topic, service, publisher
        self.dead_letters = DeadLetters(service, publisher.send_bytes)
        self.start, self.capacity, self.poll_ms = start, capacity, poll_ms
        self.tracker = OffsetTracker()
        self.running: dict[tuple[TopicPartition, int], asyncio.Task[None]] = {}
        self.failed: BaseException | None = None
        self.assignments = 0  # counts rebalances: what was fetched before one is fetched again
        self.consumer = clients.consumer(
            bootstrap_servers, client_id=client_id, consumer_group=consumer_group,
            auto_offset_reset="earliest", isolation_level="read_committed", **options,
        )  # fmt: skip
        self.answers = None if answers is None else AnsweredRollouts(
            bootstrap_servers, answers, client_id=client_id,
            assigned=lambda: {tp.partition for tp in self.consumer.assignment()},
        )  # fmt: skip

    async def run(self, stop: asyncio.Event, drain_timeout: float = 0.0) -> None:
        """Consume until ``stop`` is set; then give running work ``drain_timeout`` seconds to end, commit
        what ended, and cancel the rest (left uncommitted)."""
        try:
            self.consumer.subscribe([self.topic], listener=_Rebalance(self))
            await self.consumer.start()
            while not stop.is_set() and self.failed is None:
                await self.poll_once()
            if self.failed is not None:
                raise self.failed
            if self.running and drain_timeout > 0:
                await asyncio.wait(list(self.running.values()), timeout=drain_timeout)
                await self.commit(self.consumer.assignment())
        finally:
            await self._abandon()
            with contextlib.suppress(Exception):
                await self.consumer.stop()

    async def poll_once(self) -> None:
        free = self.capacity - len(self.running)
        assigned = self.consumer.assignment()
        if free <= 0:
            self.consumer.pause(*assigned)
        else:
            self.consumer.resume(*assigned)
        batch = await self.consumer.getmany(timeout_ms=self.poll_ms, max_records=max(free, 1))
        assignment = self.assignments
        for partition, messages in batch.items():
            for message in messages:
                if self.assignments != assignment:
                    break  # a rebalance meanwhile: positions went back to the commits, the rest comes again
                if not await self._take(partition, message):
                    break  # sought back to this message: the rest of its partition comes again
        await self.commit(self.consumer.assignment())

    async def _take(self, partition: TopicPartition, message: ConsumerRecord) -> bool:
        """Start the work of ``message``, or end it at once; False if it must be fetched again (the answers
        could not be read). Anything awaited here may span a rebalance, after which the message is left
        alone (it is fetched again from the committed offset)."""
        if self.tracker.seen(partition, message.offset):
            return True  # redelivered after a rebalance while it runs (or ended, not yet committed)
        assignment = self.assignments
        event = await self.dead_letters.decoded(message, decode)
        if event is None:
            self._done_at_once(partition, message.offset, assignment)
            return True
        if self.answers is not None:
            try:
                answered = await self.answers.answered(partition.partition, event.rollout_id)
            except (KafkaError, OSError, TimeoutError):  # the broker away: keep running work, ask later
                log.warning("reading %s failed: offset %s of %s is fetched again", self.answers.topic,
                            message.offset, partition, exc_info=True)  # fmt: skip
                if self.assignments == assignment and partition in self.consumer.assignment():
                    self.consumer.seek(partition, message.offset)
                await asyncio.sleep(ANSWERS_RETRY_S)
                return False
            if answered:
                log.warning("%s: rollout %s is already answered on %s (its work ended before offset %s "
                            "was committed): committed, not done again", partition, event.rollout_id,
                            self.answers.topic, message.offset)  # fmt: skip
                self._done_at_once(partition, message.offset, assignment)
                return True
        if self.assignments != assignment:
            return True
        self.tracker.start(partition, message.offset)
        work = self.start(event)
        if work is None:
            self.tracker.end(partition, message.offset)
            return True
        key = (partition, message.offset)
        self.running[key] = asyncio.create_task(self._work(key, work), name=event.rollout_id)
        return True

    def _done_at_once(self, partition: TopicPartition, offset: int, assignment: int) -> None:
        if self.assignments == assignment:
            self.tracker.start(partition, offset)
            self.tracker.end(partition, offset)

    async def _work(self, key: tuple[TopicPartition, int], work: Work) -> None:
        try:
            await work
            self.tracker.end(*key)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the work failed for good: stop; its message stays uncommitted
            self.failed = exc
        finally:
            self.running.pop(key, None)

    async def commit(self, partitions: set[TopicPartition]) -> None:
        commits = self.tracker.to_commit(partitions)
        if not commits:
            return
        try:
            await self.consumer.commit({tp: OffsetAndMetadata(n, "") for tp, n in commits.items()})
        except Exception:  # a rebalance in progress: the next poll commits again
            log.warning("offset commit failed; will retry", exc_info=True)
            return
        self.tracker.committed(commits)

    def reassigned(self, assigned: set[TopicPartition]) -> None:
        """Partitions another member now owns: their running work is abandoned (it does it again). Answers
        are read afresh: another member may have answered meanwhile."""
        self.assignments += 1
        if self.answers is not None:
            self.answers.forget()
        lost = {tp for tp, _ in self.running} - assigned
        for (tp, offset), task in list(self.running.items()):
            if tp in lost:
                log.warning("partition %s moved to another member: abandoning offset %s", tp, offset)
                task.cancel()
        self.tracker.forget(self.tracker.partitions() - assigned)

    async def _abandon(self) -> None:
        """Stopping: cancel all running work; its messages stay uncommitted."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


def decode(message: ConsumerRecord) -> Event:
    return decode_message(message, MAX_EVENT_BYTES)
