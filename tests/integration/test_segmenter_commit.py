"""The segmenter's commit logs and waits for its table writes, over the real broker and Faust's producer.

Faust's own flush gives a queued message 0.1 s and then lets the consumer commit; here the buffer hands each
write over slowly (0.3 s, as on a starved event loop), and the flush that precedes a commit must still
return only once every write is acked, so a ``kill -9`` after the commit cannot lose one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from services.segmenter.app import build_app
from services.segmenter.settings import SegmenterSettings
from tests.segmenter_support import namespace_of

pytestmark = pytest.mark.kafka


async def test_the_flush_before_a_commit_waits_for_every_queued_table_write(
    kafka_bootstrap: str, topics: dict[str, str], tmp_path: Path
) -> None:
    settings = SegmenterSettings(
        bootstrap_servers=kafka_bootstrap, namespace=namespace_of(topics), state_dir=tmp_path
    )
    app = build_app(settings, partitions=3)
    buffer = app.producer.buffer
    hand_over = buffer._send_pending

    async def slowly(message: object) -> None:
        await asyncio.sleep(0.3)
        await hand_over(message)

    buffer._send_pending = slowly  # read once by the buffer's drain task when it starts
    await app.producer.start()
    try:
        table = app.tables["rollouts"]
        await table.changelog_topic.maybe_declare()
        writes = [table.send_changelog(i % 3, f"r-{i}".encode(), b"{}") for i in range(4)]
        await app.producer.flush()
        assert all(w.done() and not w.exception() for w in writes)
        assert {w.result().topic for w in writes} == {table.changelog_topic_name}
    finally:
        await app.producer.stop()


async def changelog(bootstrap: str, topic: str) -> list[tuple[int, bytes, bytes | None]]:
    """(partition, key, value) of every message in a changelog topic, in each partition's order."""
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest"
    )
    await consumer.start()
    logged: list[tuple[int, bytes, bytes | None]] = []
    try:
        while batch := await consumer.getmany(timeout_ms=3000):
            logged += [(m.partition, m.key, m.value) for ms in batch.values() for m in ms]
        return logged
    finally:
        await consumer.stop()


async def test_buffered_table_writes_reach_the_changelog_at_the_flush_once_per_key(
    kafka_bootstrap: str, topics: dict[str, str], tmp_path: Path
) -> None:
    """The segmenter's tables log each key's latest change when a commit flushes, on the partition of the
    event that made it; a body written and deleted in between never reaches the changelog, a body that had
    reached it gets a tombstone. Nothing is sent before the flush."""
    settings = SegmenterSettings(
        bootstrap_servers=kafka_bootstrap, namespace=namespace_of(topics), state_dir=tmp_path
    )
    app = build_app(settings, partitions=3)
    states, bodies = app.segmenter.states, app.segmenter.bodies
    await app.producer.start()
    try:
        for table in (app.tables["rollouts"], app.tables["turn-bodies"]):
            await table.changelog_topic.maybe_declare()
        states.partition_of = bodies.partition_of = lambda: 2
        bodies["kept"], bodies["gone"] = b"body-1", b"body-2"
        await app.producer.flush()  # what precedes a commit
        states["r-1"], states["r-1"] = b'{"seq":1}', b'{"seq":2}'
        bodies["brief"] = b"body-3"
        del bodies["brief"], bodies["gone"]
        assert states["r-1"] == b'{"seq":2}' and "brief" not in bodies and states.pending == 1
        await app.producer.flush()
        assert states.pending == bodies.pending == 0
        logged_states = await changelog(kafka_bootstrap, app.tables["rollouts"].changelog_topic_name)
        logged_bodies = await changelog(kafka_bootstrap, app.tables["turn-bodies"].changelog_topic_name)
    finally:
        await app.producer.stop()
    assert logged_states == [(2, b"r-1", b'{"seq":2}')]
    assert logged_bodies == [(2, b"kept", b"body-1"), (2, b"gone", b"body-2"), (2, b"gone", None)]


async def test_the_worker_s_consumer_fetches_with_the_settings_minimum_and_wait(
    kafka_bootstrap: str, topics: dict[str, str], tmp_path: Path
) -> None:
    """Faust builds its aiokafka consumer with a one-byte minimum and no setting for it: the fetcher the
    worker's consumer starts (what its fetch requests are built from) carries the settings' values."""
    settings = SegmenterSettings(
        bootstrap_servers=kafka_bootstrap,
        namespace=namespace_of(topics),
        state_dir=tmp_path,
        fetch_min_bytes=123_456,
        fetch_max_wait=0.25,
    )
    app = build_app(settings, partitions=3)
    thread = app.consumer._thread
    consumer = thread._create_worker_consumer(thread.transport)
    await consumer.start()
    try:
        assert (consumer._fetcher._fetch_min_bytes, consumer._fetcher._fetch_max_wait_ms) == (123_456, 250)
    finally:
        await consumer.stop()
