"""The runner service: a consumer-group member on `tasks` that runs up to ``concurrency`` rollouts at once.

Rollouts last up to 30 minutes, far beyond Kafka's poll interval, so the loop never blocks on them: it keeps
polling (the group keeps this member), pauses every partition while it is at capacity, and commits a
partition's offset only up to its oldest task still running (:mod:`rollbus.kafka.in_flight`). Killed
mid-rollout, a runner leaves those tasks uncommitted: the group hands them to another runner (or to this one
restarted), which runs each as a new attempt, unless the task's diff is already on `diffs` (a runner killed
between publishing it and committing the task): that task is committed and not run again, so no rollout gets
two rewarded attempts (:mod:`rollbus.kafka.answered`). Gym tasks (``env_config`` set) belong to another
runner and are passed over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from rollbus.events import DiffEvent, TaskEvent
from rollbus.kafka.bus import Event, Publisher
from rollbus.kafka.in_flight import InFlightConsumer
from rollbus.kafka.topics import topic_name
from rollbus.services.sandbox_runner.outcome import AttemptResult, diff_event
from rollbus.services.sandbox_runner.rerun import rerun_task
from rollbus.services.sandbox_runner.rollout import AdapterSessions, RunnerKit, run_task
from rollbus.services.sandbox_runner.settings import RunnerSettings

log = logging.getLogger("rollbus.sandbox_runner")
PUBLISH_TRIES = 5

RunTask = Callable[[RunnerKit, dict[str, Any]], Any]


def is_gym_task(record: dict[str, Any]) -> bool:
    return bool(record.get("env_config"))


async def publish_outcome(
    publisher: Publisher, topic: str, task: dict[str, Any], outcome: AttemptResult, rerun: str | None = None
) -> None:
    """Publish the attempt's diff (naming ``rerun``, the re-run submitted for it), retrying while the broker
    is away (the task stays uncommitted)."""
    await publish_retrying(publisher, topic, diff_event(task, outcome, rerun_rollout_id=rerun), "diff")


async def publish_retrying(publisher: Publisher, topic: str, event: DiffEvent | TaskEvent, what: str) -> None:
    for attempt in range(PUBLISH_TRIES):
        try:
            await publisher.publish(topic, event)
            return
        except Exception:
            if attempt == PUBLISH_TRIES - 1:
                raise
            log.warning("publishing the %s of %s failed; retrying", what, event.rollout_id, exc_info=True)
            await asyncio.sleep(2**attempt)


class SandboxRunner:
    """The consumer loop; :meth:`run` until ``stop`` is set (in-flight attempts are then abandoned)."""

    def __init__(self, settings: RunnerSettings, *, run: RunTask = run_task) -> None:
        self.settings = settings
        self.tasks_topic = topic_name("tasks", settings.namespace)
        self.diffs_topic = topic_name("diffs", settings.namespace)
        self._run = run
        self.publisher = Publisher(settings.bootstrap_servers, client_id="rollbus-sandbox-runner")
        self.tasks = InFlightConsumer(
            settings.bootstrap_servers, self.tasks_topic, consumer_group=settings.consumer_group,
            client_id="rollbus-sandbox-runner", service="sandbox-runner", publisher=self.publisher,
            start=self._start, capacity=settings.concurrency, poll_ms=settings.poll_ms,
            answers=self.diffs_topic, session_timeout_ms=settings.session_timeout_ms,
            heartbeat_interval_ms=max(settings.session_timeout_ms // 4, 250),
            fetch_max_wait_ms=settings.fetch_wait_ms, consumer_timeout_ms=settings.consumer_timeout_ms,
        )  # fmt: skip
        sessions = AdapterSessions(
            settings.adapter_url, settings.admin(), settings.close_timeout, settings.adapter_wait
        )
        self.kit = RunnerKit(settings, sessions)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            async with self.publisher:
                await self.tasks.run(stop)
        finally:
            await self.kit.sessions.aclose()

    def _start(self, event: Event) -> Coroutine[Any, Any, None] | None:
        if is_gym_task(event.record):
            return None  # the gym runner's
        return self._rollout(event.record)

    async def _rollout(self, task: dict[str, Any]) -> None:
        outcome = await self._run(self.kit, task)
        rerun = rerun_task(TaskEvent.from_dict(task), outcome.failure_kind, self.settings.infra_retries)
        if rerun is not None:  # before the diff: a failed sample on the bus always has its re-run there
            await publish_retrying(self.publisher, self.tasks_topic, rerun, "re-run")
            log.warning("rollout %s failed by the infrastructure (%s): re-run %d as %s", task["rollout_id"],
                        outcome.failure_kind, rerun.attempt, rerun.rollout_id)  # fmt: skip
        rerun_id = rerun.rollout_id if rerun is not None else None
        await publish_outcome(self.publisher, self.diffs_topic, task, outcome, rerun_id)
        log.info("rollout %s attempt %s ended: %s", task["rollout_id"], outcome.attempt_id,
                 outcome.failure_kind or "finished")  # fmt: skip
