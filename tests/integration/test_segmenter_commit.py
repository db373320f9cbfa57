"""The segmenter's commit waits for its table writes, over the real broker and Faust's producer.

Faust's own flush gives a queued message 0.1 s and then lets the consumer commit; here the buffer hands each
write over slowly (0.3 s, as on a starved event loop). Faust alone returns from that flush with writes still
queued; the segmenter's flush (:func:`~rollbus.services.segmenter.upstream_fixes.commit_after_changelogs`)
returns only once every write is acked, so a ``kill -9`` after the commit cannot lose one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import faust
import pytest

from rollbus.services.segmenter.app import build_app, table
from rollbus.services.segmenter.settings import SegmenterSettings
from tests.segmenter_support import namespace_of

pytestmark = pytest.mark.kafka


def slow_hand_over(app: faust.App) -> None:
    """Each queued message reaches aiokafka 0.3 s late (read once, when the buffer's drain task starts)."""
    buffer = app.producer.buffer
    hand_over = buffer._send_pending

    async def slowly(message: object) -> None:
        await asyncio.sleep(0.3)
        await hand_over(message)

    buffer._send_pending = slowly


async def flushed_writes(app: faust.App, rollouts: Any) -> list[Any]:
    """Four changelog writes, then the flush that precedes a commit; the writes' futures as it returns."""
    slow_hand_over(app)
    await app.producer.start()
    try:
        await rollouts.changelog_topic.maybe_declare()
        writes = [rollouts.send_changelog(i % 3, f"r-{i}", b"{}") for i in range(4)]
        await app.producer.flush()
        return [(w.done() and not w.exception() and w.result().topic) for w in writes]
    finally:
        await app.producer.stop()


async def test_faust_alone_commits_with_table_writes_still_queued(
    kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    """The upstream defect the fix closes: Faust's flush returns before the writes are even sent."""
    app = faust.App(f"plain-{namespace_of(topics)}", broker=f"kafka://{kafka_bootstrap}")
    flushed = await flushed_writes(app, table(app, namespace_of(topics), "rollouts", 3))
    assert flushed.count(False) >= 2


async def test_the_flush_before_a_commit_waits_for_every_queued_table_write(
    kafka_bootstrap: str, topics: dict[str, str], tmp_path: Path
) -> None:
    settings = SegmenterSettings(
        bootstrap_servers=kafka_bootstrap, namespace=namespace_of(topics), state_dir=tmp_path
    )
    app = build_app(settings, partitions=3)
    rollouts = app.tables["rollouts"]
    assert await flushed_writes(app, rollouts) == [rollouts.changelog_topic_name] * 4
