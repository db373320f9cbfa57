"""The real segmenter (a Faust worker started by ``rollbus segmenter``) over the real broker.

Each test gets its own topic namespace, consumer group and changelogs. What is exercised: rollouts with
sub-agents and compactions segmented, two attempts (only the rewarded one trains), duplicates dropped,
poison dead-lettered while processing goes on, timeouts, kill -9 and restart, a second worker taking over
partitions, and ``rollbus rebuild segments`` equal to the live topic.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys

import pytest

from rollbus.kafka import clients
from rollbus.kafka.bus import Publisher
from rollbus.services.segmenter.segmentation import segment_id
from tests.segmenter_support import (
    SegmenterProcess,
    namespace_of,
    publish,
    read_all,
    unique_segments,
)
from tests.synthetic_rollouts import simple_rollout
from tests.waiting import until

pytestmark = pytest.mark.kafka


async def test_rollouts_are_segmented_duplicates_dropped_poison_dead_lettered(
    kafka_bootstrap, topics, tmp_path
):
    ns = namespace_of(topics)
    first, second = simple_rollout("r-a", attempt="x"), simple_rollout("r-a", attempt="y", reward=0.5)
    two_attempts = [e for e in first.events if e[0] != "rewards"] + second.events
    other = simple_rollout("r-b", turns=5)
    with_duplicates = [
        e for event in other.events for e in ([event, event] if event[0] == "turns" else [event])
    ]
    async with Publisher(kafka_bootstrap) as publisher:
        await publisher.publish_bytes(topics["turns"], b"\x00garbage", key=b"r-a")
    await publish(kafka_bootstrap, topics, two_attempts + with_duplicates)
    with SegmenterProcess(kafka_bootstrap, ns, tmp_path) as worker:
        segments = await read_all(kafka_bootstrap, topics["segments"], until=6, timeout=90, worker=worker)
        letters = await read_all(kafka_bootstrap, topics["dead-letters"], until=1, timeout=30)
    kept = unique_segments(segments)
    assert sorted(kept) == sorted(
        [segment_id("r-a", "y", i) for i in range(3)] + [segment_id("r-b", "a1", i) for i in range(3)]
    ), worker.log()[-3000:]
    assert {s["trajectory_reward"] for s in kept.values() if s["rollout_id"] == "r-a"} == {0.5}
    assert [s["kind"] for s in sorted(kept.values(), key=lambda s: s["segment_id"])][:3] == [
        "subagent", "wipe", "final"
    ]  # fmt: skip
    assert len(letters) == 1 and letters[0]["value"] == b"\x00garbage" and "bad magic" in letters[0]["error"]


def test_the_worker_starts_through_the_project_entry_point() -> None:
    """``rollbus segmenter --help`` lists the settings (Faust's own CLI, with its click pin, is not used)."""
    shown = subprocess.run(
        [sys.executable, "-m", "rollbus", "segmenter", "--help"], capture_output=True, text=True, check=True
    )
    assert "--rollout-timeout" in shown.stdout and "ROLLBUS_SEGMENTER_ROLLOUT_TIMEOUT" in shown.stdout


def rebuild_segments(bootstrap: str, ns: str, into: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "rollbus", "rebuild", "segments", "--into", into,
         "--bootstrap-servers", bootstrap, "--namespace", ns],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


async def test_kill_9_and_restart_lose_nothing_and_rebuild_equals_live(kafka_bootstrap, topics, tmp_path):
    """Rollouts published in waves while the worker is killed -9 at arbitrary points and restarted: after
    deduplication by id every segment is there exactly once, and a rebuild from the raw topics equals it."""
    ns = namespace_of(topics)
    rollouts = [simple_rollout(f"k-{i}", turns=2 + i % 4) for i in range(12)]
    waves = [rollouts[0:4], rollouts[4:8], rollouts[8:12]]
    worker = SegmenterProcess(kafka_bootstrap, ns, tmp_path).start()
    try:
        for wave in waves:
            await publish(kafka_bootstrap, topics, [e for w in wave for e in w.events])
            await asyncio.sleep(1.0 + 2.5 * random.random())  # mid-recovery, mid-batch, or idle
            worker.kill()
            worker = SegmenterProcess(kafka_bootstrap, ns, tmp_path).start()
        live = await read_all(kafka_bootstrap, topics["segments"], until=36, timeout=120, worker=worker)
    finally:
        worker.stop()
    kept = unique_segments(live)
    assert sorted(kept) == sorted(segment_id(w.rollout_id, "a1", i) for w in rollouts for i in range(3))
    summary = rebuild_segments(kafka_bootstrap, ns, f"{ns}.rebuilt")
    rebuilt = unique_segments(await read_all(kafka_bootstrap, f"{ns}.rebuilt", until=36, timeout=30))
    assert summary["segments"] == 36 and rebuilt == kept
    assert "Error in recovery" not in worker.log()  # restarts recovered the tables from their changelogs


async def test_rebuild_refuses_a_topic_that_is_not_fresh(kafka_bootstrap, topics):
    ns = namespace_of(topics)
    await publish(kafka_bootstrap, topics, simple_rollout("f-1").events)
    rebuild_segments(kafka_bootstrap, ns, f"{ns}.again")
    done = subprocess.run(
        [sys.executable, "-m", "rollbus", "rebuild", "segments", "--into", f"{ns}.again",
         "--bootstrap-servers", kafka_bootstrap, "--namespace", ns],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "already holds messages" in done.stderr


async def test_a_rollout_that_never_closes_times_out_and_its_late_reward_is_dead_lettered(
    kafka_bootstrap, topics, tmp_path
):
    ns = namespace_of(topics)
    lost = simple_rollout("t-lost")
    events = [e for e in lost.events if e[0] == "turns"]  # the runner died: no close, no diff, no reward
    await publish(kafka_bootstrap, topics, events)
    with SegmenterProcess(kafka_bootstrap, ns, tmp_path, "--rollout-timeout", "2") as worker:

        async def aborted() -> bool:
            assert worker.proc.poll() is None, worker.log()[-3000:]
            return "rollout t-lost aborted, nothing trainable" in worker.log()

        await until(aborted, "the abort", timeout=60, interval=0.3, log=worker.log)
        await publish(kafka_bootstrap, topics, [lost.events[-1]])
        letters = await read_all(kafka_bootstrap, topics["dead-letters"], until=1, timeout=60, worker=worker)
    assert "no reward" in worker.log() and '"aborted": 1' in worker.log()
    assert "reward for rollout t-lost, which is already aborted" in letters[0]["error"]
    assert await read_all(kafka_bootstrap, topics["segments"]) == []


async def test_a_second_worker_takes_partitions_over_mid_rollout(kafka_bootstrap, topics, tmp_path):
    """Half of each rollout reaches worker 1; worker 2 joins, then worker 1 stops: the changelogs carry the
    halves over, and every rollout is cut once (after deduplication by id)."""
    ns = namespace_of(topics)
    rollouts = [simple_rollout(f"b-{i}", turns=3) for i in range(9)]
    halves = [(w.events[: len(w.events) // 2], w.events[len(w.events) // 2 :]) for w in rollouts]
    first = SegmenterProcess(kafka_bootstrap, ns, tmp_path, name="w1").start()
    second = SegmenterProcess(kafka_bootstrap, ns, tmp_path, name="w2")
    try:
        await publish(
            kafka_bootstrap, topics, [e for head, _ in halves for e in head] + rollouts[0].events[-1:]
        )
        await publish(kafka_bootstrap, topics, halves[0][1])
        await read_all(kafka_bootstrap, topics["segments"], until=3, timeout=90, worker=first)
        second.start()
        await asyncio.sleep(8)  # the group rebalances; worker 2 recovers its partitions' tables
        await publish(kafka_bootstrap, topics, [e for _, tail in halves[1:5] for e in tail])
        first.stop()
        await publish(kafka_bootstrap, topics, [e for _, tail in halves[5:] for e in tail])
        segments = await read_all(kafka_bootstrap, topics["segments"], until=27, timeout=120, worker=second)
    finally:
        first.stop()
        second.stop()
    kept = unique_segments(segments)
    assert sorted(kept) == sorted(segment_id(w.rollout_id, "a1", i) for w in rollouts for i in range(3)), (
        f"worker 1:\n{first.log()[-3000:]}\nworker 2:\n{second.log()[-3000:]}"
    )
    assert "Error in recovery" not in second.log()


async def test_start_fails_fast_when_an_internal_topic_has_another_partition_count(kafka_bootstrap, topics):
    from aiokafka.admin import NewTopic

    ns = namespace_of(topics)
    async with clients.admin(kafka_bootstrap, client_id="test-topics") as admin:
        await admin.create_topics([NewTopic(f"{ns}.segmenter-ticks", 2, 1)])
    done = subprocess.run(
        [sys.executable, "-m", "rollbus", "segmenter",
         "--bootstrap-servers", kafka_bootstrap, "--namespace", ns],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"need the inputs' 3 partitions, found {ns}.segmenter-ticks=2" in done.stderr
