"""``rollbus sandbox-runner``: consumes `tasks`, runs the agent in a sandbox per attempt, publishes `diffs`.

Library use (``rollbus demo``, tests): :func:`run_one` runs one task to its diff event without Kafka;
:class:`~rollbus.services.sandbox_runner.service.SandboxRunner` is the service loop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from rollbus.codec import default_codec
from rollbus.sandbox import bwrap_usable
from rollbus.serve import run_service
from rollbus.services.sandbox_runner.outcome import diff_event
from rollbus.services.sandbox_runner.rollout import AdapterSessions, RunnerKit, run_task
from rollbus.services.sandbox_runner.service import SandboxRunner
from rollbus.services.sandbox_runner.settings import RunnerSettings

log = logging.getLogger("rollbus.sandbox_runner")
add_arguments = RunnerSettings.add_arguments


async def run_one(settings: RunnerSettings, task: dict[str, Any]) -> dict[str, Any]:
    """Run ``task`` (a `tasks` record) once as a new attempt; its `diffs` record (not published), as the dict
    a reader of the topic decodes."""
    sessions = AdapterSessions(
        settings.adapter_url, settings.admin(), settings.close_timeout, settings.adapter_wait
    )
    try:
        outcome = await run_task(RunnerKit(settings, sessions), task)
    finally:
        await sessions.aclose()
    return diff_event(task, outcome).to_dict()


def run(args: argparse.Namespace) -> int:
    settings = RunnerSettings.from_args(args)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if settings.backend == "bwrap" and not bwrap_usable():
        print(
            "rollbus sandbox-runner: bwrap cannot build sandboxes here (use --backend local)", file=sys.stderr
        )
        return 2
    if settings.backend == "docker" and (problem := docker_unusable()):
        print(f"rollbus sandbox-runner: --backend docker: {problem}", file=sys.stderr)
        return 2
    if settings.backend == "e2b" and (problem := e2b_unusable()):
        print(f"rollbus sandbox-runner: --backend e2b: {problem}", file=sys.stderr)
        return 2
    return run_service("sandbox-runner", lambda stop: _serve(settings, stop), bus=settings)


def docker_unusable() -> str | None:
    """Why no container could be made from here (no engine answers and none can start), or None."""
    try:
        import docker  # noqa: F401 - only needed for this backend
    except ImportError:
        return "the docker SDK is not installed (pip install docker; the dev group has it)"
    from rollbus.sandbox import docker_engine

    try:
        docker_engine.client().close()
    except docker_engine.EngineUnavailable as exc:
        return str(exc)
    return None


def e2b_unusable() -> str | None:
    """Why no E2B VM could be made from here (every attempt would fail), or None."""
    try:
        import e2b  # noqa: F401 - only needed for this backend
    except ImportError:
        return "the e2b SDK is not installed (pip install 'e2b>=2')"
    if not os.environ.get("E2B_API_KEY"):
        return "E2B_API_KEY is not set"
    return None


async def _serve(settings: RunnerSettings, stop: asyncio.Event) -> int:
    if settings.backend == "docker":  # what a runner killed -9 left: containers that sleep forever, mounts
        from rollbus.sandbox import docker_backend, docker_engine

        client = docker_engine.client()
        swept = await asyncio.to_thread(docker_backend.sweep_stale, client, settings.sandbox_root)
        if swept:
            log.info("swept %d docker sandboxes of dead runners", len(swept))
    runner = SandboxRunner(settings)
    default_codec()  # the schemas, loaded once here (~0.1 CPU-s), not by the first task in the middle of work
    log.info("consuming %s as group %s: %d rollouts at once, %d booting, budget %.0fs, %s, adapter %s",
             runner.tasks_topic, settings.consumer_group, settings.concurrency, settings.boot_concurrency,
             settings.agent_timeout, settings.backend, settings.adapter_url)  # fmt: skip
    await runner.run(stop)
    return 0
