"""The segmenter refuses Faust, aiokafka or mode versions its upstream fixes were not proven against, and the
end of a recovery seeks the streams with the flow stopped and no hand-over under way (the other fixes are
tested over the real broker: tests/integration/test_segmenter_commit.py, test_segmenter_seek.py)."""

from __future__ import annotations

import asyncio
import weakref
from importlib import metadata
from pathlib import Path

import faust
import faust.streams
import pytest
from faust.exceptions import PartitionsMismatch

from rollbus.services.segmenter.app import TABLES, build_app
from rollbus.services.segmenter.settings import SegmenterSettings
from rollbus.services.segmenter.upstream_fixes import (
    PROVEN,
    UnprovenUpstream,
    check_versions,
    seek_before_streams_resume,
)


def test_the_installed_versions_are_the_proven_ones() -> None:
    check_versions()  # the pins in pyproject.toml and PROVEN agree
    assert {name: metadata.version(name) for name in PROVEN} == PROVEN


def test_another_version_is_refused_naming_what_was_found_and_what_was_proven() -> None:
    found = {**PROVEN, "aiokafka": "0.15.0"}
    with pytest.raises(UnprovenUpstream) as refused:
        check_versions(found.__getitem__)
    message = str(refused.value)
    assert f"aiokafka 0.15.0 (proven: {PROVEN['aiokafka']})" in message
    assert "faust-streaming" not in message and "upstream_fixes.py" in message


def test_a_missing_distribution_is_refused() -> None:
    def installed(name: str) -> str:
        if name == "mode-streaming":
            raise metadata.PackageNotFoundError(name)
        return PROVEN[name]

    with pytest.raises(UnprovenUpstream, match=r"mode-streaming not installed \(proven: "):
        check_versions(installed)


async def test_the_end_of_a_recovery_stops_the_flow_and_waits_for_the_hand_over_under_way() -> None:
    """Faust's real consumer, flow control and ``wait_first`` (the fetcher's hand-over, here of a delivery
    that never ends on its own); Faust's completion of the recovery (resume the streams, seek them, empty
    their queues) is stood in for by a recorder of what it would find. Without the fix it finds the flow on
    and the hand-over under way: what is handed over during its seek is then thrown away."""
    app = faust.App("recovery-end", broker="kafka://127.0.0.1:9")  # never started
    consumer, recovery = app.consumer, app.tables.recovery
    found: list[tuple[bool, bool, bool]] = []

    async def completed(generation_id: int = 0) -> None:
        found.append((consumer.flow_active, app.flow_control.is_active(), hand_over.done()))

    recovery.on_recovery_completed = completed
    seek_before_streams_resume(app)
    consumer.resume_flow()
    app.flow_control.resume()
    never, delivering = asyncio.Event(), asyncio.Event()

    async def delivery() -> None:
        delivering.set()  # wait_first runs it: the hand-over is under way
        await never.wait()

    hand_over = asyncio.ensure_future(consumer.wait_first(delivery(), consumer.suspend_flow.wait()))
    await asyncio.wait_for(delivering.wait(), 10)
    assert not hand_over.done()
    await recovery.on_recovery_completed(1)
    assert found == [(False, False, True)]


class Message:
    def __init__(self, topic: str, partition: int) -> None:
        self.topic, self.partition = topic, partition


class Event:
    def __init__(self, message: Message) -> None:
        self.message = message


def test_a_table_change_goes_to_the_event_s_partition_when_the_consumer_knows_no_changelog_partitions(
    tmp_path: Path,
) -> None:
    """The consumer's metadata holds the just-created changelog with 0 partitions (as it did for a whole
    bench run): Faust's own table refuses the write; the segmenter's tables log it to the event's partition.
    Stand-ins: the consumer's answer and the current event (set as a stream sets it)."""
    settings = SegmenterSettings(bootstrap_servers="127.0.0.1:9", namespace="ns", state_dir=tmp_path)
    app = build_app(settings, partitions=6)
    app.consumer.topic_partitions = lambda topic: 0 if topic.endswith("-changelog") else 6
    plain = app.Table("plain", key_type=str, value_type=bytes, partitions=6)
    event = Event(Message("ns.turns", 4))
    token = faust.streams._current_event.set(weakref.ref(event))
    try:
        with pytest.raises(PartitionsMismatch, match="has 0 partitions"):
            plain.partition_for_key("r-1")
        assert [app.tables[name].partition_for_key("r-1") for name in TABLES] == [4, 4]
    finally:
        faust.streams._current_event.reset(token)
