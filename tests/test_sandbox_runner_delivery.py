"""The runner's delivery over a real broker, with the attempt itself stood in by a function the test releases:
commits never pass a running task, gym tasks are passed over, capacity pauses consumption, a runner that
stops mid-rollout leaves its task to the next one (at-least-once, as a new attempt), and a task whose diff is
already on the bus is committed without running again (so a rollout gets one rewarded attempt)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from rollbus.kafka import clients
from rollbus.kafka.bus import Publisher
from rollbus.kafka.topics import create_topics, topic_name
from rollbus.services.sandbox_runner.outcome import AttemptResult, diff_event
from rollbus.services.sandbox_runner.service import SandboxRunner
from rollbus.services.sandbox_runner.settings import RunnerSettings
from tests.conftest import unique_namespace
from tests.runner_support import all_events
from tests.waiting import count_polls, until

pytestmark = pytest.mark.kafka
GROUP = "runner-delivery"


class Gate:
    """A stand-in attempt: records which tasks started and ends each when the test releases it."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    async def __call__(self, kit: Any, task: dict[str, Any]) -> AttemptResult:
        self.started.append(task["rollout_id"])
        await self.release.setdefault(task["rollout_id"], asyncio.Event()).wait()
        return AttemptResult(f"att-{task['rollout_id']}", patch=b"", exit_status=0)

    def end(self, rollout_id: str) -> None:
        self.release.setdefault(rollout_id, asyncio.Event()).set()


def task(rollout_id: str, **extra: Any) -> dict[str, Any]:
    metadata = json.dumps({"image": "/nowhere"})
    return {"rollout_id": rollout_id, "group_id": "g", "sample_index": 0, "group_size": 1, "prompt": "p",
            "label": None, "metadata": metadata, "submitted_at": 0, **extra}  # fmt: skip


@pytest.fixture
async def namespace(kafka_bootstrap: str) -> str:
    name = unique_namespace()
    await create_topics(kafka_bootstrap, 1, name)  # one partition: the order of tasks is the offset order
    return name


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return count_polls(monkeypatch)


@contextlib.asynccontextmanager
async def runner(
    bootstrap: str, namespace: str, gate: Gate, concurrency: int
) -> AsyncIterator[SandboxRunner]:
    settings = RunnerSettings.load({
        "bootstrap_servers": bootstrap, "namespace": namespace, "consumer_group": GROUP,
        "concurrency": concurrency, "poll_ms": 100,
    })  # fmt: skip
    service = SandboxRunner(settings, run=gate)
    stop = asyncio.Event()
    loop = asyncio.create_task(service.run(stop))
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(loop, 60)


async def committed(bootstrap: str, namespace: str) -> int:
    async with clients.started_consumer(
        bootstrap, client_id="test-committed", consumer_group=GROUP
    ) as consumer:
        return await consumer.committed(TopicPartition(topic_name("tasks", namespace), 0)) or 0


async def publish(bootstrap: str, namespace: str, *records: dict[str, Any]) -> None:
    async with Publisher(bootstrap) as publisher:
        await publisher.publish_many(topic_name("tasks", namespace), list(records))


async def test_commits_wait_for_the_oldest_running_task(
    kafka_bootstrap: str, namespace: str, polls: list[int]
) -> None:
    gate = Gate()
    gym = task("gym-2", env_config=json.dumps({"env": "x"}))
    await publish(kafka_bootstrap, namespace, task("t0"), task("t1"), gym, task("t3"))
    async with runner(kafka_bootstrap, namespace, gate, concurrency=3):
        await until(lambda: len(gate.started) == 3, "three tasks started")
        assert gate.started == ["t0", "t1", "t3"], "the gym task is passed over"
        gate.end("t1")
        gate.end("t3")
        await until(lambda: diff_count(kafka_bootstrap, namespace, 2), "2 diffs")
        ended = polls[0]
        await until(lambda: polls[0] >= ended + 2, "two more polls, each of which would commit past t0")
        assert await committed(kafka_bootstrap, namespace) == 0
        gate.end("t0")
        await until(lambda: commit_is(kafka_bootstrap, namespace, 4), "offset 4 committed")
    diffs = await all_events(kafka_bootstrap, namespace, "diffs")
    assert sorted(d["rollout_id"] for d in diffs) == ["t0", "t1", "t3"]


async def test_capacity_pauses_and_a_stopped_runner_leaves_its_task_to_the_next(
    kafka_bootstrap: str, namespace: str, polls: list[int]
) -> None:
    first = Gate()
    await publish(kafka_bootstrap, namespace, task("a"), task("b"))
    async with runner(kafka_bootstrap, namespace, first, concurrency=1):
        await until(lambda: first.started == ["a"], "a started")
        ended = polls[0]
        await until(lambda: polls[0] >= ended + 3, "three more polls, each of which would start b")
        assert first.started == ["a"], "at capacity nothing else starts"
        first.end("a")
        await until(lambda: first.started == ["a", "b"], "b started")
        await until(lambda: commit_is(kafka_bootstrap, namespace, 1), "offset 1 committed")
    # stopped with b running: b was abandoned, its offset not committed
    assert await committed(kafka_bootstrap, namespace) == 1
    second = Gate()
    second.end("b")
    async with runner(kafka_bootstrap, namespace, second, concurrency=1):
        await until(lambda: commit_is(kafka_bootstrap, namespace, 2), "offset 2 committed")
    assert second.started == ["b"]
    diffs = await all_events(kafka_bootstrap, namespace, "diffs")
    assert [(d["rollout_id"], d["attempt_id"]) for d in diffs] == [("a", "att-a"), ("b", "att-b")]


async def diff_count(bootstrap: str, namespace: str, n: int) -> bool:
    return len(await all_events(bootstrap, namespace, "diffs")) >= n


async def commit_is(bootstrap: str, namespace: str, offset: int) -> bool:
    return await committed(bootstrap, namespace) == offset


async def test_a_poison_task_goes_to_dead_letters_and_the_next_task_still_runs(
    kafka_bootstrap: str, namespace: str
) -> None:
    gate = Gate()
    gate.end("after")
    async with Publisher(kafka_bootstrap) as publisher:
        await publisher.publish_bytes(topic_name("tasks", namespace), b"not an event", key=b"poison")
    await publish(kafka_bootstrap, namespace, task("after"))
    async with runner(kafka_bootstrap, namespace, gate, concurrency=1):
        await until(lambda: commit_is(kafka_bootstrap, namespace, 2), "offset 2 committed")
    assert gate.started == ["after"]
    (letter,) = await all_events(kafka_bootstrap, namespace, "dead-letters")
    assert letter["value"] == b"not an event" and letter["service"] == "sandbox-runner"


async def test_a_task_whose_diff_is_on_the_bus_is_committed_and_not_run_again(
    kafka_bootstrap: str, namespace: str
) -> None:
    """A runner killed after publishing ``a``'s diff and before committing ``a``: the next one reads
    ``diffs``, commits ``a`` without a new attempt, and runs ``b``. On the code before, ``a`` ran again."""
    gate = Gate()
    gate.end("a")
    gate.end("b")
    killed = AttemptResult("att-a-killed", patch=b"", exit_status=0)
    async with Publisher(kafka_bootstrap) as publisher:
        await publisher.publish(topic_name("diffs", namespace), diff_event(task("a"), killed))
    await publish(kafka_bootstrap, namespace, task("a"), task("b"))
    async with runner(kafka_bootstrap, namespace, gate, concurrency=2):
        await until(lambda: commit_is(kafka_bootstrap, namespace, 2), "offset 2 committed")
    assert gate.started == ["b"]
    diffs = await all_events(kafka_bootstrap, namespace, "diffs")
    assert [(d["rollout_id"], d["attempt_id"]) for d in diffs] == [("a", "att-a-killed"), ("b", "att-b")]


async def test_a_failed_read_of_diffs_fetches_the_task_again_and_still_skips_it(
    kafka_bootstrap: str, namespace: str
) -> None:
    """The broker away while the runner reads ``diffs`` (the first read fails here): the loop keeps going,
    fetches the task again, reads again, and still does not run the answered task."""
    gate = Gate()
    gate.end("b")
    async with Publisher(kafka_bootstrap) as publisher:
        answer = diff_event(task("a"), AttemptResult("att-a-0"))
        await publisher.publish(topic_name("diffs", namespace), answer)
    await publish(kafka_bootstrap, namespace, task("a"), task("b"))
    async with runner(kafka_bootstrap, namespace, gate, concurrency=2) as service:
        answers = service.tasks.answers  # the loop has not run yet: nothing was read
        assert answers is not None
        read, failures = answers._read, []

        async def read_failing_once(partitions: set[int]) -> dict[int, set[str]]:
            if not failures:
                failures.append(partitions)
                raise KafkaConnectionError("the broker is away")
            return await read(partitions)

        answers._read = read_failing_once  # type: ignore[method-assign]
        await until(lambda: commit_is(kafka_bootstrap, namespace, 2), "offset 2 committed")
    assert failures == [{0}] and gate.started == ["b"]


async def test_an_injected_infrastructure_failure_is_rerun_as_a_new_rollout_up_to_the_budget(
    kafka_bootstrap: str, namespace: str
) -> None:
    """The real attempt (``run_task``) with ``--inject-infra-failures 2 --infra-retries 1``: the first
    creation fails, so the sample is re-run as ``row-g.r1-0`` (attempt 1, same group and sample index),
    published on ``tasks`` before the diff that names it; the re-run's creation fails too and the budget is
    spent: its diff names no re-run. Both failures are ``boot_failed`` with the injection in the error."""
    settings = RunnerSettings.load({
        "bootstrap_servers": kafka_bootstrap, "namespace": namespace, "consumer_group": GROUP,
        "poll_ms": 100, "inject_infra_failures": 2, "infra_retries": 1, "boot_attempts": 3,
    })  # fmt: skip
    await publish(kafka_bootstrap, namespace, task("row-g-0", group_id="row-g", group_size=2))
    service, stop = SandboxRunner(settings), asyncio.Event()
    loop = asyncio.create_task(service.run(stop))
    try:
        await until(lambda: diff_count(kafka_bootstrap, namespace, 2), "2 diffs")
    finally:
        stop.set()
        await asyncio.wait_for(loop, 60)
    tasks = await all_events(kafka_bootstrap, namespace, "tasks")
    assert [(t["rollout_id"], t["attempt"], t["sample_index"], t["group_id"]) for t in tasks] == [
        ("row-g-0", 0, 0, "row-g"), ("row-g.r1-0", 1, 0, "row-g"),
    ]
    diffs = {d["rollout_id"]: d for d in await all_events(kafka_bootstrap, namespace, "diffs")}
    assert {r: (d["failure_kind"], d["rerun_rollout_id"]) for r, d in diffs.items()} == {
        "row-g-0": ("boot_failed", "row-g.r1-0"), "row-g.r1-0": ("boot_failed", None),
    }
    assert all("injected infrastructure failure" in (d["error"] or "") for d in diffs.values())
    assert service.kit.creations == 2  # not retried within the boot: each injection ends its attempt
