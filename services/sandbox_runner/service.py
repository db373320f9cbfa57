"""The runner service: a consumer-group member on `tasks` that runs up to ``concurrency`` rollouts at once.

Rollouts last up to 30 minutes, far beyond Kafka's poll interval, so the loop never blocks on them: it keeps
polling (the group keeps this member), pauses every partition while it is at capacity, and commits a
partition's offset only up to its oldest task still running (:mod:`offsets`). Killed mid-rollout, a runner
leaves those tasks uncommitted: the group hands them to another runner (or to this one restarted), which runs
each as a new attempt. Gym tasks (``env_config`` set) belong to another runner and are passed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.structs import OffsetAndMetadata

from rollbus.bus import Publisher, dead_letter, decode_message
from rollbus.codec import CodecError
from rollbus.services.sandbox_runner.offsets import OffsetTracker
from rollbus.services.sandbox_runner.outcome import AttemptResult, diff_event
from rollbus.services.sandbox_runner.rollout import AdapterSessions, RunnerKit, run_task
from rollbus.services.sandbox_runner.settings import RunnerSettings
from rollbus.topics import MAX_EVENT_BYTES, dead_letters_for, topic_name

log = logging.getLogger("rollbus.sandbox_runner")
PUBLISH_TRIES = 5

RunTask = Callable[[RunnerKit, dict[str, Any]], Any]


def is_gym_task(record: dict[str, Any]) -> bool:
    return bool(record.get("env_config"))


async def publish_outcome(
    publisher: Publisher, topic: str, task: dict[str, Any], outcome: AttemptResult
) -> None:
    """Publish the attempt's diff, retrying while the broker is away (the task stays uncommitted)."""
    event = diff_event(task, outcome)
    for attempt in range(PUBLISH_TRIES):
        try:
            await publisher.publish(topic, event)
            return
        except Exception:
            if attempt == PUBLISH_TRIES - 1:
                raise
            log.warning("publishing the diff of %s failed; retrying", task["rollout_id"], exc_info=True)
            await asyncio.sleep(2**attempt)


class _Rebalance(ConsumerRebalanceListener):
    """Commit what is done before partitions go; forget and cancel what did not come back."""

    def __init__(self, runner: SandboxRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self.runner.commit(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.runner.reassigned(assigned)


class SandboxRunner:
    """The consumer loop; :meth:`run` until ``stop`` is set (in-flight attempts are then abandoned)."""

    def __init__(self, settings: RunnerSettings, *, run: RunTask = run_task) -> None:
        self.settings = settings
        self.tasks_topic = topic_name("tasks", settings.namespace)
        self.diffs_topic = topic_name("diffs", settings.namespace)
        self._run = run
        self.tracker = OffsetTracker()
        self.running: dict[tuple[TopicPartition, int], asyncio.Task[None]] = {}
        self.failed: BaseException | None = None
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.bootstrap_servers, group_id=settings.consumer_group,
            client_id="rollbus-sandbox-runner", enable_auto_commit=False, auto_offset_reset="earliest",
            isolation_level="read_committed", session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=max(settings.session_timeout_ms // 4, 250),
        )  # fmt: skip
        self.publisher = Publisher(settings.bootstrap_servers, client_id="rollbus-sandbox-runner")
        self.kit = RunnerKit(settings, AdapterSessions(settings.adapter_url, settings.admin(),
                                                       settings.close_timeout))  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await self.publisher.__aenter__()
            self.consumer.subscribe([self.tasks_topic], listener=_Rebalance(self))
            await self.consumer.start()
            while not stop.is_set() and self.failed is None:
                await self.poll_once()
            if self.failed is not None:
                raise self.failed
        finally:
            await self._abandon()
            with contextlib.suppress(Exception):
                await self.consumer.stop()
            with contextlib.suppress(Exception):
                await self.publisher.__aexit__(None, None, None)
            await self.kit.sessions.aclose()

    async def poll_once(self) -> None:
        free = self.settings.concurrency - len(self.running)
        assigned = self.consumer.assignment()
        if free <= 0:
            self.consumer.pause(*assigned)
        else:
            self.consumer.resume(*assigned)
        batch = await self.consumer.getmany(timeout_ms=self.settings.poll_ms, max_records=max(free, 1))
        for partition, messages in batch.items():
            for message in messages:
                await self._take(partition, message)
        await self.commit(self.consumer.assignment())

    async def _take(self, partition: TopicPartition, message: ConsumerRecord) -> None:
        if self.tracker.seen(partition, message.offset):
            return  # redelivered after a rebalance while it runs (or ended, not yet committed)
        self.tracker.start(partition, message.offset)
        try:
            event = decode_message(message, MAX_EVENT_BYTES)
        except CodecError as poison:
            await self.publisher.publish(
                dead_letters_for(message.topic),
                dead_letter(message, poison, "sandbox-runner"),
                key=message.key,
            )
            self.tracker.end(partition, message.offset)
            return
        if is_gym_task(event.record):
            self.tracker.end(partition, message.offset)
            return
        key = (partition, message.offset)
        self.running[key] = asyncio.create_task(
            self._rollout(key, event.record), name=event.record["rollout_id"]
        )

    async def _rollout(self, key: tuple[TopicPartition, int], task: dict[str, Any]) -> None:
        try:
            outcome = await self._run(self.kit, task)
            await publish_outcome(self.publisher, self.diffs_topic, task, outcome)
            self.tracker.end(*key)
            log.info("rollout %s attempt %s ended: %s", task["rollout_id"], outcome.attempt_id,
                     outcome.failure_kind or "finished")  # fmt: skip
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # publishing failed for good: stop; the task stays uncommitted
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
        """Partitions another runner now owns: their running attempts are abandoned (it re-runs them)."""
        lost = {tp for tp, _ in self.running} - assigned
        for (tp, offset), task in list(self.running.items()):
            if tp in lost:
                log.warning(
                    "partition %s moved to another runner: abandoning the task at offset %s", tp, offset
                )
                task.cancel()
        self.tracker.forget(self.tracker.partitions() - assigned)

    async def _abandon(self) -> None:
        """Stopping: kill every running attempt (sandbox and session); their tasks stay uncommitted."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
