"""Replay and tail against a real broker: positions, time, key filter, and a clean exit at the end."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import UTC, datetime

import pytest

from rollbus.kafka.bus import Publisher
from rollbus.kafka.replay import ReadPlan, read
from tests.event_samples import SAMPLES

pytestmark = pytest.mark.kafka


async def publish_turns(bootstrap: str, topic: str, rollouts: list[str]) -> list:
    async with Publisher(bootstrap) as bus:
        return [
            await bus.publish(topic, {**SAMPLES["turn"], "rollout_id": r, "turn_index": i})
            for i, r in enumerate(rollouts)
        ]


async def collect(bootstrap: str, plan: ReadPlan) -> list[tuple[str, int]]:
    return [(m.key.decode(), d.record["turn_index"]) async for m, d in read(bootstrap, plan)]


async def test_replay_from_beginning_with_key_filter(kafka_bootstrap: str, topics: dict) -> None:
    turns = topics["turns"]
    await publish_turns(kafka_bootstrap, turns, ["a", "b", "a", "c", "a"])
    assert await collect(kafka_bootstrap, ReadPlan(turns, key=b"a")) == [("a", 0), ("a", 2), ("a", 4)]
    assert len(await collect(kafka_bootstrap, ReadPlan(turns))) == 5
    assert len(await collect(kafka_bootstrap, ReadPlan(turns, limit=2))) == 2


async def test_replay_from_offset_and_since_time(kafka_bootstrap: str, topics: dict) -> None:
    turns = topics["turns"]
    first = await publish_turns(kafka_bootstrap, turns, ["r"] * 3)
    await asyncio.sleep(0.05)  # the next batch must carry a later broker timestamp than the first
    later = await publish_turns(kafka_bootstrap, turns, ["r"] * 2)
    from_offset = await collect(kafka_bootstrap, ReadPlan(turns, start="offset", offset=2))
    assert [i for _, i in from_offset] == [2, 0, 1]
    since = await collect(kafka_bootstrap, ReadPlan(turns, start="since", since_ms=later[0].timestamp))
    assert [i for _, i in since] == [0, 1]
    assert first[-1].timestamp < later[0].timestamp


async def test_tail_starts_at_the_end_and_follows_new_events(kafka_bootstrap: str, topics: dict) -> None:
    turns = topics["turns"]
    await publish_turns(kafka_bootstrap, turns, ["old"])
    follower = asyncio.create_task(
        collect(kafka_bootstrap, ReadPlan(turns, start="end", follow=True, limit=2))
    )
    sent = 0
    while not follower.done() and sent < 100:  # keep publishing: no guess at when the follower is ready
        await publish_turns(kafka_bootstrap, turns, [f"new-{sent}"])
        sent += 1
        await asyncio.sleep(0.2)
    seen = await asyncio.wait_for(follower, timeout=10)
    assert len(seen) == 2 and all(key.startswith("new-") for key, _ in seen)


def test_replay_cli_prints_json_lines_and_exits_at_end(kafka_bootstrap: str, topics: dict) -> None:
    turns = topics["turns"]
    segment = {**SAMPLES["segment"], "response_ids": list(range(100))}

    async def publish() -> None:
        async with Publisher(kafka_bootstrap) as bus:
            await bus.publish(topics["segments"], segment)
            await bus.publish_bytes(turns, b"junk-bytes", key="r-9")

    asyncio.run(publish())
    env = {**os.environ, "ROLLBUS_BOOTSTRAP_SERVERS": kafka_bootstrap}
    rows = []
    for topic in (topics["segments"], turns):
        done = subprocess.run([sys.executable, "-m", "rollbus", "replay", topic, "--from-beginning"],
                              capture_output=True, text=True, env=env, timeout=120, check=True)  # fmt: skip
        rows += [json.loads(line) for line in done.stdout.splitlines()]
    record = rows[0]["event"]["record"]
    assert record["response_ids"] == "[100 ids: 0, 1, 2 … 99]"
    assert rows[0]["key"] == "r-1" and rows[0]["topic"] == topics["segments"]
    assert datetime.fromisoformat(rows[0]["timestamp"]).tzinfo == UTC
    assert "bad magic" in rows[1]["error"]
