"""``rollbus gym-runner``: consumes ``tasks`` that carry an ``env_config``, runs each as a gym episode through
the adapter's OpenAI endpoint, publishes ``rewards``. Tasks without ``env_config`` are not ours: skipped.

Delivery is the sandbox runner's (:mod:`rollbus.kafka.in_flight`): up to ``--concurrency`` episodes run
while the consumer polls on, and a task's offset is committed only once its episode has ended and its
reward is published, and every task before it too. On SIGTERM/SIGINT the runner stops taking tasks, lets
running episodes finish for ``--drain-timeout`` seconds, then cancels the rest (each env is closed, each
adapter session closed); their tasks stay uncommitted, as do those of a runner killed outright, so the
group hands them to the next runner, which runs each episode again as a new attempt, unless its reward is
already on ``rewards`` (a runner killed between publishing it and committing the task): that task is
committed and not run again, so no rollout is rewarded twice (:mod:`rollbus.kafka.answered`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import httpx

import rollbus.services.gym_runner.envs  # noqa: F401  (registers the built-ins before any plugin: a plugin may replace one)
from rollbus.events import RewardEvent, TaskEvent
from rollbus.kafka.bus import Event, Publisher
from rollbus.kafka.in_flight import InFlightConsumer
from rollbus.kafka.topics import topic_name
from rollbus.serve import run_service
from rollbus.services.gym_runner.adapter_client import AdapterClient
from rollbus.services.gym_runner.gym import GymConfigError, context_managers, envs, load_plugins
from rollbus.services.gym_runner.runner import GymRunner
from rollbus.services.gym_runner.settings import GymRunnerSettings
from rollbus.settings import SettingsError

log = logging.getLogger("rollbus.gym_runner")
add_arguments = GymRunnerSettings.add_arguments


def run(args: argparse.Namespace) -> int:
    settings = GymRunnerSettings.from_args(args)
    if settings.admin_token is None:
        raise SettingsError("--admin-token: required (the adapter's admin token, to open sessions)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
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
    return run_service("gym-runner", lambda stop: serve(settings, stop), bus=settings)


async def serve(settings: GymRunnerSettings, stop: asyncio.Event) -> None:
    """Consume tasks until ``stop`` is set, then drain (see the module docstring)."""
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

        async def publish(topic: str, record: RewardEvent) -> None:
            await publisher.publish(topic_name(topic, ns), record)

        runner = GymRunner(settings, adapter, publish)

        def start(event: Event) -> Coroutine[Any, Any, Any] | None:
            task = event.event_as(TaskEvent)
            if not task.env_config:
                return None  # a coding-agent task: the sandbox runner's
            return runner.run_task(task)

        tasks = InFlightConsumer(
            settings.bootstrap_servers, topic_name("tasks", ns), consumer_group=settings.consumer_group,
            client_id="gym-runner", service="gym-runner", publisher=publisher, start=start,
            capacity=settings.concurrency, answers=topic_name("rewards", ns),
        )  # fmt: skip
        await tasks.run(stop, drain_timeout=settings.drain_timeout)
