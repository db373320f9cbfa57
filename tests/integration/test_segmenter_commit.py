"""The segmenter's commit waits for its table writes, over the real broker and Faust's real producer.

Faust's own flush gives a queued message 0.1 s and then lets the consumer commit; here the buffer hands each
write over slowly (0.3 s, as on a starved event loop), and the flush that precedes a commit must still
return only once every write is acked, so a ``kill -9`` after the commit cannot lose one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

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
