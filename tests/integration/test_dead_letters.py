"""Poison messages go to dead-letters with their original bytes and the error; consumption goes on."""

from __future__ import annotations

import uuid

import pytest

from rollbus.codec import HEADER, decode, encode
from rollbus.kafka.bus import Event, EventConsumer, PermanentError, Publisher
from tests.event_samples import SAMPLES
from tests.integration.test_bus import drain, read_raw

pytestmark = pytest.mark.kafka


def with_schema_version(data: bytes, version: int) -> bytes:
    magic, type_id, _ = HEADER.unpack_from(data)
    return HEADER.pack(magic, type_id, version) + data[HEADER.size :]


async def consume_all(bootstrap: str, topic: str, want: int, **options) -> list[Event]:
    handled: list[Event] = []

    async def handle(event: Event) -> None:
        if event.record.get("request_id") == "refuse":
            raise PermanentError("turn references a chain that never existed")
        handled.append(event)

    async with EventConsumer(bootstrap, [topic], consumer_group=f"g-{uuid.uuid4().hex[:8]}", handler=handle,
                             service="segmenter", **options) as consumer:  # fmt: skip
        await drain(consumer, want)
    return handled


async def test_poison_messages_are_dead_lettered_and_the_consumer_keeps_going(
    kafka_bootstrap: str, topics: dict
) -> None:
    turns = topics["turns"]
    good = encode("turn", SAMPLES["turn"])
    poison = {
        b"not-rollbus": b"\x00\x01garbage",
        b"future-schema": with_schema_version(good, 99),
        b"truncated": good[:-4],
        b"wrong-type": encode("reward", SAMPLES["reward"]),
        b"oversized": good + b"\x00" * 20_000,
    }
    async with Publisher(kafka_bootstrap) as bus:
        await bus.publish(turns, SAMPLES["turn"], key="r-1")
        for key, value in poison.items():
            await bus.publish_bytes(turns, value, key=key)
        await bus.publish(turns, {**SAMPLES["turn"], "request_id": "refuse"}, key="refused")
        await bus.publish(turns, {**SAMPLES["turn"], "request_id": "last"}, key="r-1")

    handled = await consume_all(kafka_bootstrap, turns, want=8, max_event_bytes=10_000)

    assert [e.record["request_id"] for e in handled] == ["req-7", "last"]
    letters = {m.key: decode(m.value).record for m in await read_raw(kafka_bootstrap, topics["dead-letters"])}
    assert set(letters) == {*poison, b"refused"}
    for key, original in poison.items():
        assert letters[key]["value"] == original
        assert letters[key]["source_topic"] == turns
        assert letters[key]["service"] == "segmenter"
    assert "schema version 99" in letters[b"future-schema"]["error"]
    assert "bad magic" in letters[b"not-rollbus"]["error"]
    assert letters[b"oversized"]["error"].startswith("OversizedEvent: message of 20")
    assert "over the limit of 10000" in letters[b"oversized"]["error"]
    assert "reward event on" in letters[b"wrong-type"]["error"]
    assert letters[b"refused"]["error"].startswith("PermanentError: turn references a chain")


async def test_dead_lettered_messages_are_committed(kafka_bootstrap: str, topics: dict) -> None:
    """A restarted group does not see the poison again: it was handled, by dead-lettering."""
    turns, consumer_group = topics["turns"], f"g-{uuid.uuid4().hex[:8]}"
    seen: list[Event] = []

    async def handle(event: Event) -> None:
        seen.append(event)

    async with Publisher(kafka_bootstrap) as bus:
        await bus.publish_bytes(turns, b"junk-bytes", key="r-1")
        async with EventConsumer(kafka_bootstrap, [turns], consumer_group=consumer_group, handler=handle,
                                 service="test") as consumer:  # fmt: skip
            assert await drain(consumer, 1) == 1
        await bus.publish(turns, SAMPLES["turn"])  # same key, same partition, after the poison
    async with EventConsumer(kafka_bootstrap, [turns], consumer_group=consumer_group, handler=handle,
                             service="test") as consumer:  # fmt: skip
        assert await drain(consumer, 1) == 1
    assert [e.record["request_id"] for e in seen] == ["req-7"]
    assert len(await read_raw(kafka_bootstrap, topics["dead-letters"])) == 1
