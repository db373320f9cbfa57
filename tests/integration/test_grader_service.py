"""The grader service over the real broker: diffs in, the expected rewards out, poison dead-lettered, and
only a rollout's first diff rewarded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from typing import Any

import pytest
from aiokafka import TopicPartition

from rollbus.codec import decode
from rollbus.grading import absolute_paths
from rollbus.kafka import clients
from rollbus.kafka.bus import Event, Publisher
from rollbus.kafka.topics import describe
from rollbus.services.grader.main import DiffGrader, serve
from rollbus.services.grader.settings import GraderSettings
from tests.integration.test_bus import read_raw
from tests.test_grading_swe_mini import CHEATS, SWE_MINI, load_build

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def diff(
    rollout_id: str, row: dict[str, Any] | None, patch: str, *, absolute: bool = True, **extra: Any
) -> dict:
    metadata = "{}"
    if row is not None:
        meta = absolute_paths(row["metadata"], SWE_MINI) if absolute else row["metadata"]
        metadata = json.dumps(meta)
    return {
        "rollout_id": rollout_id, "patch": patch.encode(), "exit_status": 0, "wall_time_s": 1.0, "turns": 3,
        "error": None, "at": int(time.time() * 1000), "attempt_id": f"{rollout_id}-a1",
        "group_id": "g1", "group_size": 4, "task_metadata": metadata, "label": None, **extra,
    }  # fmt: skip


async def wait_for(bootstrap: str, topic: str, count: int, timeout: float = 120) -> list:
    deadline = time.monotonic() + timeout
    while True:
        messages = await read_raw(bootstrap, topic)
        if len(messages) >= count or time.monotonic() > deadline:
            return messages
        await asyncio.sleep(0.5)


async def test_grader_publishes_rewards_and_dead_letters_poison(
    kafka_bootstrap: str, topics: dict[str, str], rows: dict[str, dict[str, Any]]
) -> None:
    diffs = [
        diff("r-lru-fixed", rows["lru"], rows["lru"]["label"]),  # swepro
        diff("r-slug-fixed", rows["slugify"], rows["slugify"]["label"], absolute=False),  # via data_dir
        diff("r-roman-empty", rows["roman"], ""),
        diff("r-conftest", rows["lru"], (CHEATS / "conftest_passes_everything.patch").read_text()),
        diff(
            "r-crashed",
            rows["median"],
            rows["median"]["label"],
            failure_kind="agent_crashed",
            error="exit 137",
        ),
        diff("r-truncated", rows["median"], rows["median"]["label"][:50], patch_truncated=True),
        diff("r-bad-row", None, rows["median"]["label"]),
    ]
    async with Publisher(kafka_bootstrap) as bus:
        for record in diffs:
            await bus.publish(topics["diffs"], record)
        await bus.publish(topics["diffs"], diff("", rows["lru"], ""), key=b"no-rollout-id")
        await bus.publish_bytes(topics["diffs"], b"\x00\x01not a diff", key=b"poison")

    namespace = topics["diffs"].rsplit(".", 1)[0]
    settings = GraderSettings.load({
        "bootstrap_servers": kafka_bootstrap, "namespace": namespace, "data_dir": SWE_MINI,
        "consumer_group": f"grader-{uuid.uuid4().hex[:8]}",
    })  # fmt: skip
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop))
    try:
        rewards = await wait_for(kafka_bootstrap, topics["rewards"], len(diffs))
        letters = await wait_for(kafka_bootstrap, topics["dead-letters"], 2)
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)

    by_id = {r["rollout_id"]: r for r in (decode(m.value).record for m in rewards)}
    assert len(rewards) == len(diffs) == len(by_id)
    expected = {
        "r-lru-fixed": (1.0, None), "r-slug-fixed": (1.0, None), "r-roman-empty": (0.0, "tests_failed"),
        "r-conftest": (0.0, "tampered"), "r-crashed": (0.0, "rollout_failed"),
        "r-truncated": (0.0, "patch_truncated"), "r-bad-row": (0.0, "bad_row"),
    }  # fmt: skip
    assert {k: (r["reward"], r["failure_kind"]) for k, r in by_id.items()} == expected
    fixed = by_id["r-lru-fixed"]
    assert fixed["solved"] and fixed["applied_cleanly"]
    assert (fixed["attempt_id"], fixed["group_id"], fixed["group_size"]) == ("r-lru-fixed-a1", "g1", 4)
    assert {"name": "tests/test_lru.py::test_get_refreshes_recency", "status": "PASSED"} in fixed["tests"]
    assert "touches_conftest" in by_id["r-conftest"]["flags"]
    assert json.loads(by_id["r-crashed"]["details"])["rollout_failure"] == "agent_crashed"
    assert "no image" in json.loads(by_id["r-bad-row"]["details"])["note"]

    dead = {m.key: decode(m.value).record for m in letters}
    assert set(dead) == {b"no-rollout-id", b"poison"}
    assert dead[b"poison"]["value"] == b"\x00\x01not a diff" and dead[b"poison"]["service"] == "grader"
    assert "without a rollout_id" in dead[b"no-rollout-id"]["error"]


async def test_rollbus_grader_process_grades_and_stops_on_sigterm(
    kafka_bootstrap: str, topics: dict[str, str], rows: dict[str, dict[str, Any]]
) -> None:
    """The real command: settings from flags and variables, one diff graded, SIGTERM ends it with status 0."""
    namespace = topics["diffs"].rsplit(".", 1)[0]
    async with Publisher(kafka_bootstrap) as bus:
        await bus.publish(topics["diffs"], diff("r-proc", rows["intervals"], rows["intervals"]["label"]))
    env = {**os.environ, "ROLLBUS_NAMESPACE": namespace, "ROLLBUS_GRADER_GRADE_TIMEOUT": "120"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollbus", "grader", "--bootstrap-servers", kafka_bootstrap,
        "--consumer-group", f"grader-{uuid.uuid4().hex[:8]}", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        rewards = await wait_for(kafka_bootstrap, topics["rewards"], 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert [decode(m.value).record["reward"] for m in rewards] == [1.0]
    assert proc.returncode == 0, output.decode()
    assert b"rollout r-proc attempt r-proc-a1: reward 1.0" in output


async def test_a_reward_too_large_for_the_bus_keeps_its_verdict(
    kafka_bootstrap: str, topics: dict[str, str], rows: dict[str, dict[str, Any]]
) -> None:
    """Per-test results and logs are dropped, never the reward: the rollout is still graded."""
    namespace = topics["diffs"].rsplit(".", 1)[0]
    settings = GraderSettings.load({"bootstrap_servers": kafka_bootstrap, "namespace": namespace})
    record = diff("r-big", rows["leapyear"], rows["leapyear"]["label"])
    async with Publisher(kafka_bootstrap, max_event_bytes=1200) as publisher:
        await DiffGrader(settings, publisher)(Event(topics["diffs"], 0, 0, 0, None, "diff", 2, record))
    [message] = await wait_for(kafka_bootstrap, topics["rewards"], 1)
    reward = decode(message.value).record
    assert (reward["rollout_id"], reward["reward"], reward["solved"], reward["tests"]) == (
        "r-big",
        1.0,
        True,
        [],
    )
    assert "too large" in json.loads(reward["details"])["note"]


async def uncommitted(bootstrap: str, topic: str, group: str) -> int:
    """Messages of ``topic`` the group has not committed past."""
    partitions = [TopicPartition(topic, p) for p in range((await describe(bootstrap, [topic]))[topic])]
    async with clients.started_consumer(bootstrap, client_id="test-lag", consumer_group=group) as consumer:
        ends = await consumer.end_offsets(partitions)
        return sum([ends[tp] - (await consumer.committed(tp) or 0) for tp in partitions])


async def test_only_a_rollouts_first_diff_is_rewarded(kafka_bootstrap: str, topics: dict[str, str]) -> None:
    """A second diff of one rollout (a runner that ran its task again) is committed with no reward, so the
    rollout has one rewarded attempt; before, both attempts were rewarded."""
    failed = {"failure_kind": "timeout", "error": "killed at the budget"}  # graded without a sandbox
    diffs = [diff("twice", None, "", attempt_id="twice-a1", **failed),
             diff("twice", None, "", attempt_id="twice-a2", **failed),
             diff("once", None, "", attempt_id="once-a1", **failed)]  # fmt: skip
    async with Publisher(kafka_bootstrap) as bus:
        for record in diffs:
            await bus.publish(topics["diffs"], record)
    group = f"grader-{uuid.uuid4().hex[:8]}"
    namespace = topics["diffs"].rsplit(".", 1)[0]
    settings = GraderSettings.load({"bootstrap_servers": kafka_bootstrap, "namespace": namespace,
                                    "consumer_group": group})  # fmt: skip
    stop = asyncio.Event()
    service = asyncio.create_task(serve(settings, stop))
    try:
        async with asyncio.timeout(180):
            while await uncommitted(kafka_bootstrap, topics["diffs"], group):
                assert not service.done(), service
                await asyncio.sleep(0.5)
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
    rewards = [decode(m.value).record for m in await read_raw(kafka_bootstrap, topics["rewards"])]
    rewarded = sorted((r["rollout_id"], r["attempt_id"]) for r in rewards)
    assert rewarded == [("once", "once-a1"), ("twice", "twice-a1")]
