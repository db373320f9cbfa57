"""The bus against a real broker: every event type round-trips, commits follow handler success,
transactions are all-or-nothing for read-committed readers."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka import TopicPartition

from rollbus.codec import decode
from rollbus.events import EVENTS
from rollbus.kafka import clients
from rollbus.kafka.bus import Event, EventConsumer, EventTooLarge, Publisher, key_for
from tests.event_samples import SAMPLES

pytestmark = pytest.mark.kafka


async def drain(consumer: EventConsumer, want: int, rounds: int = 20) -> int:
    """Poll until ``want`` messages were handled (or dead-lettered), or give up after ``rounds`` polls."""
    done = 0
    for _ in range(rounds):
        done += await consumer.poll(500)
        if done >= want:
            break
    return done


async def read_raw(bootstrap: str, topic: str, *, isolation_level: str = "read_committed") -> list:
    """Every message on ``topic`` from the beginning, as a fresh group-less reader sees it."""
    reader = clients.consumer(
        bootstrap, topic, client_id="test-read", auto_offset_reset="earliest", isolation_level=isolation_level
    )
    await reader.start()
    try:
        partitions = [TopicPartition(topic, p) for p in reader.partitions_for_topic(topic) or ()]
        end = await reader.end_offsets(partitions)
        messages = []
        for _ in range(20):
            batch = await reader.getmany(timeout_ms=300)
            messages += [m for ms in batch.values() for m in ms]
            if all([await reader.position(tp) >= end[tp] for tp in partitions]):
                break
        return messages
    finally:
        await reader.stop()


def group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


async def test_every_event_type_round_trips_keyed_by_rollout(kafka_bootstrap: str, topics: dict) -> None:
    async with Publisher(kafka_bootstrap) as bus:
        for spec in EVENTS:
            await bus.publish(topics[spec.topic], SAMPLES[spec.event_type])
    for spec in EVENTS:
        seen: list[Event] = []

        async def handle(event: Event, seen: list[Event] = seen) -> None:
            seen.append(event)

        async with EventConsumer(
            kafka_bootstrap, [topics[spec.topic]], consumer_group=group(), handler=handle, service="test"
        ) as consumer:
            await drain(consumer, 1)
        assert [e.event_type for e in seen] == [spec.event_type]
        expected = {**SAMPLES[spec.event_type], "schema_version": seen[0].schema_version}
        assert seen[0].record == expected
        assert seen[0].key == key_for(topics[spec.topic], SAMPLES[spec.event_type])


async def test_one_rollout_lands_on_the_same_partition_of_every_topic(
    kafka_bootstrap: str, topics: dict
) -> None:
    partitions = set()
    async with Publisher(kafka_bootstrap) as bus:
        for name in ("tasks", "turns", "sessions", "diffs", "rewards", "segments"):
            event_type = next(s.event_type for s in EVENTS if s.topic == name)
            record = {**SAMPLES[event_type], "rollout_id": "rollout-42"}
            partitions.add((await bus.publish(topics[name], record)).partition)
    assert len(partitions) == 1


async def test_transaction_commit_is_visible_and_abort_is_not(kafka_bootstrap: str, topics: dict) -> None:
    turns = topics["turns"]
    async with Publisher(kafka_bootstrap, transactional_id=f"tx-{uuid.uuid4().hex[:8]}") as bus:
        async with bus.transaction():
            await bus.publish(turns, {**SAMPLES["turn"], "request_id": "committed"})
        with pytest.raises(RuntimeError, match="give up"):
            async with bus.transaction():
                await bus.publish(turns, {**SAMPLES["turn"], "request_id": "aborted"})
                raise RuntimeError("give up")
    committed = await read_raw(kafka_bootstrap, turns)
    everything = await read_raw(kafka_bootstrap, turns, isolation_level="read_uncommitted")
    assert [decode(m.value).record["request_id"] for m in committed] == ["committed"]
    assert sorted(decode(m.value).record["request_id"] for m in everything) == ["aborted", "committed"]


async def test_publish_returns_once_the_broker_has_each_event(kafka_bootstrap: str, topics: dict) -> None:
    async with Publisher(kafka_bootstrap) as bus:
        offsets = [
            (await bus.publish(topics["rewards"], {**SAMPLES["reward"], "reward": float(i)})).offset
            for i in range(5)
        ]
    assert offsets == list(range(5))
    assert len(await read_raw(kafka_bootstrap, topics["rewards"])) == 5


async def test_failed_handler_commits_nothing_and_restart_redelivers(
    kafka_bootstrap: str, topics: dict
) -> None:
    diffs, consumer_group = topics["diffs"], group()
    async with Publisher(kafka_bootstrap) as bus:
        await bus.publish(diffs, {**SAMPLES["diff"], "turns": 1})
        await bus.publish(diffs, {**SAMPLES["diff"], "turns": 2})

    async def crash_on_second(event: Event) -> None:
        if event.record["turns"] == 2:
            raise ConnectionError("grader sandbox went away")

    async with EventConsumer(kafka_bootstrap, [diffs], consumer_group=consumer_group, handler=crash_on_second,
                             service="test") as consumer:  # fmt: skip
        with pytest.raises(ConnectionError):
            await drain(consumer, 2)

    redelivered: list[int] = []

    async def record(event: Event) -> None:
        redelivered.append(event.record["turns"])

    async with EventConsumer(kafka_bootstrap, [diffs], consumer_group=consumer_group, handler=record,
                             service="test") as consumer:  # fmt: skip
        await drain(consumer, 1)
    assert redelivered == [2]  # the first was committed, the failed one comes back


async def test_consumer_retrying_in_process_sees_the_failed_event_again(
    kafka_bootstrap: str, topics: dict
) -> None:
    diffs = topics["diffs"]
    async with Publisher(kafka_bootstrap) as bus:
        await bus.publish(diffs, SAMPLES["diff"])
    attempts: list[int] = []

    async def flaky(event: Event) -> None:
        attempts.append(event.offset)
        if len(attempts) == 1:
            raise TimeoutError("transient")

    async with EventConsumer(
        kafka_bootstrap, [diffs], consumer_group=group(), handler=flaky, service="test"
    ) as consumer:
        with pytest.raises(TimeoutError):
            await drain(consumer, 1)
        await drain(consumer, 1)
    assert attempts == [0, 0]


async def test_publishing_an_oversized_event_is_refused_clearly(kafka_bootstrap: str, topics: dict) -> None:
    async with Publisher(kafka_bootstrap, max_event_bytes=10_000) as bus:
        with pytest.raises(EventTooLarge, match=r"is \d+ bytes, over the limit of 10000"):
            await bus.publish(topics["turns"], {**SAMPLES["turn"], "prompt_ids": list(range(5000))})


async def test_run_stops_when_asked(kafka_bootstrap: str, topics: dict) -> None:
    stop = asyncio.Event()

    async def handle(event: Event) -> None:
        stop.set()

    async with Publisher(kafka_bootstrap) as bus:
        await bus.publish(topics["policy"], SAMPLES["policy"])
    async with EventConsumer(kafka_bootstrap, [topics["policy"]], consumer_group=group(), handler=handle,
                             service="test") as consumer:  # fmt: skip
        await asyncio.wait_for(consumer.run(stop, poll_ms=200), timeout=60)
    assert stop.is_set()


async def test_transactional_consumer_is_exactly_once_across_a_crash(
    kafka_bootstrap: str, topics: dict
) -> None:
    """Turns in, one reward out per turn: a crash mid-batch leaves no output and no commit behind."""
    turns, rewards, consumer_group = topics["turns"], topics["rewards"], group()
    async with Publisher(kafka_bootstrap) as bus:
        for i in range(3):
            await bus.publish(turns, {**SAMPLES["turn"], "rollout_id": "r-tx", "turn_index": i})

    def handler(out: Publisher, crash_at: int | None):
        async def handle(event: Event) -> None:
            await out.publish(rewards, {**SAMPLES["reward"], "rollout_id": "r-tx",
                                        "reward": float(event.record["turn_index"])})  # fmt: skip
            if event.record["turn_index"] == crash_at:
                raise ConnectionError("crashed after publishing")

        return handle

    for crash_at in (2, None):
        async with Publisher(kafka_bootstrap, transactional_id=f"tx-{consumer_group}") as out:
            async with EventConsumer(kafka_bootstrap, [turns], consumer_group=consumer_group, service="test",
                                     handler=handler(out, crash_at), publisher=out) as consumer:  # fmt: skip
                if crash_at is None:
                    assert await drain(consumer, 3) == 3
                else:
                    with pytest.raises(ConnectionError):
                        await drain(consumer, 3)
                    assert await read_raw(kafka_bootstrap, rewards) == []
    outputs = [decode(m.value).record["reward"] for m in await read_raw(kafka_bootstrap, rewards)]
    assert outputs == [0.0, 1.0, 2.0]


async def test_publish_many_keeps_each_rollouts_order(kafka_bootstrap: str, topics: dict) -> None:
    records = [{**SAMPLES["turn"], "rollout_id": f"r-{i % 4}", "turn_index": i} for i in range(40)]
    async with Publisher(kafka_bootstrap) as bus:
        acks = await bus.publish_many(topics["turns"], records)
    assert len(acks) == 40
    stored = [decode(m.value).record for m in await read_raw(kafka_bootstrap, topics["turns"])]
    for rollout in ("r-0", "r-1", "r-2", "r-3"):
        indexes = [r["turn_index"] for r in stored if r["rollout_id"] == rollout]
        assert indexes == [r["turn_index"] for r in records if r["rollout_id"] == rollout]


async def test_a_consumer_that_fails_to_start_stops_the_producer_it_started(kafka_bootstrap, topics) -> None:
    async def handler(event: Event) -> None:
        raise AssertionError("never called")

    consumer = EventConsumer(
        kafka_bootstrap,
        [topics["turns"]],
        consumer_group=f"g-{uuid.uuid4().hex}",
        handler=handler,
        service="t",
    )

    async def refuse() -> None:  # the narrowest boundary: the group join itself fails
        raise RuntimeError("consumer start failed (test)")

    consumer._consumer.start = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="consumer start failed"):
        async with consumer:
            pass
    assert consumer.publisher._producer._closed is True
