"""``rollbus gym-runner``: consumes ``tasks`` that carry an ``env_config``, runs each as a gym episode through
the adapter's OpenAI endpoint, publishes ``rewards``. Tasks without ``env_config`` are not ours: skipped.

Delivery: a task's offset is committed once its episode has *started* (so up to ``--concurrency`` episodes
run while the consumer polls on); a task still waiting for a slot at shutdown stays uncommitted, so the
group redelivers it. On SIGTERM/SIGINT the runner stops taking tasks, lets running episodes
finish for ``--drain-timeout`` seconds, then cancels the rest (each env is closed, each adapter session
closed) and publishes their tasks back to ``tasks`` so another runner picks them up. Only a hard kill loses
episodes in flight (their tasks' offsets are committed): resubmit them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
from aiokafka.errors import KafkaConnectionError

from rollbus.bus import Event, EventConsumer, Publisher
from rollbus.gym import GymConfigError, context_managers, envs, load_builtins, load_plugins
from rollbus.services.gym_runner.adapter_client import AdapterClient
from rollbus.services.gym_runner.runner import GymRunner
from rollbus.services.gym_runner.settings import GymRunnerSettings
from rollbus.settings import SettingsError
from rollbus.topics import TopicsError, check_topics, topic_name

log = logging.getLogger("rollbus.gym_runner")
add_arguments = GymRunnerSettings.add_arguments


def run(args: argparse.Namespace) -> int:
    settings = GymRunnerSettings.from_args(args)
    if settings.admin_token is None:
        raise SettingsError("--admin-token: required (the adapter's admin token, to open sessions)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    load_builtins()  # first: a plugin registering a built-in's name replaces it (and the log says so)
    try:
        load_plugins(settings.plugin_paths())
    except GymConfigError as exc:
        raise SettingsError(str(exc)) from None
    defaults = [("--gym-env", settings.gym_env, envs)]
    defaults.append(("--context-manager", settings.context_manager, context_managers))
    for flag, name, registry in defaults:
        if name and name not in registry:
            known = ", ".join(sorted(registry))
            raise SettingsError(f"{flag}: {name!r} is not registered; registered: {known}")
    try:
        asyncio.run(_main(settings))
    except (TopicsError, KafkaConnectionError) as exc:
        raise SystemExit(f"rollbus gym-runner: {exc}") from None
    return 0


async def _main(settings: GymRunnerSettings) -> None:
    await check_topics(settings.bootstrap_servers, settings.namespace)  # refuse missing/mismatched topics
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop)


class Stopping(Exception):
    """Raised by the handler when shutdown came while a task waited for a slot: the consumer then leaves
    that task uncommitted, so the next runner of the group gets it."""


class Episodes:
    """At most ``limit`` episodes at once; at shutdown, cancelled ones hand their task back."""

    def __init__(self, limit: int) -> None:
        self.slots = asyncio.Semaphore(limit)
        self.running: dict[asyncio.Task[Any], dict[str, Any]] = {}

    async def start(
        self, work: Callable[[], Coroutine[Any, Any, Any]], task: dict[str, Any], stop: asyncio.Event
    ) -> None:
        """Start ``work()`` once a slot is free; :class:`Stopping` if ``stop`` is set first."""
        acquire, stopped = asyncio.ensure_future(self.slots.acquire()), asyncio.ensure_future(stop.wait())
        await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not acquire.done() or acquire.cancelled():
            acquire.cancel()
            raise Stopping(task["rollout_id"])
        job = asyncio.create_task(work())
        self.running[job] = task
        job.add_done_callback(self._done)

    def _done(self, job: asyncio.Task[Any]) -> None:
        self.running.pop(job, None)
        self.slots.release()
        if not job.cancelled() and job.exception() is not None:
            log.error("episode failed outside the episode driver", exc_info=job.exception())

    async def drain(self, timeout: float) -> list[dict[str, Any]]:
        """Wait up to ``timeout`` s, then cancel what still runs; returns the cancelled ones' tasks."""
        jobs = dict(self.running)
        if not jobs:
            return []
        _, pending = await asyncio.wait(jobs, timeout=timeout)
        for job in pending:
            job.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return [jobs[job] for job in pending]


async def serve(settings: GymRunnerSettings, stop: asyncio.Event) -> None:
    """Consume tasks until ``stop`` is set, then drain (see the module docstring)."""
    load_builtins()
    ns = settings.namespace
    assert settings.admin_token is not None
    timeout = httpx.Timeout(settings.request_timeout, connect=10.0)
    async with (
        Publisher(settings.bootstrap_servers, client_id="gym-runner") as publisher,
        httpx.AsyncClient(base_url=settings.adapter_url, timeout=timeout) as http,
    ):
        adapter = AdapterClient(
            http, admin_token=settings.admin_token.get_secret_value(), model=settings.model,
            max_tokens=settings.max_tokens, temperature=settings.temperature,
            busy_retries=settings.busy_retries,
        )  # fmt: skip

        async def publish(topic: str, record: dict[str, Any]) -> None:
            await publisher.publish(topic_name(topic, ns), record)

        runner = GymRunner(settings, adapter, publish)
        episodes = Episodes(settings.concurrency)

        async def handle(event: Event) -> None:
            if not event.record.get("env_config"):
                return  # a coding-agent task: the sandbox runner's
            await episodes.start(lambda: runner.run_task(event.record), event.record, stop)

        poll_budget_ms = int((settings.episode_timeout * settings.attempts + 60) * 1000)
        consumer = EventConsumer(
            settings.bootstrap_servers, [topic_name("tasks", ns)], group_id=settings.consumer_group,
            handler=handle, service="gym-runner", publisher=publisher, max_batch=settings.concurrency,
            max_poll_interval_ms=poll_budget_ms,
        )  # fmt: skip
        async with consumer:
            with contextlib.suppress(Stopping):  # the waiting task stays uncommitted: redelivered later
                await consumer.run(stop)
        for task in await episodes.drain(settings.drain_timeout):
            log.warning("%s: cancelled at shutdown; task handed back to tasks", task["rollout_id"])
            with contextlib.suppress(Exception):
                await publish("tasks", task)
