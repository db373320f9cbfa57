"""The segmenter refuses Faust, aiokafka or mode versions its upstream fixes were not proven against, and the
end of a recovery seeks the streams with the flow stopped and no hand-over under way (the other fixes are
tested over the real broker: tests/integration/test_segmenter_commit.py, test_segmenter_seek.py)."""

from __future__ import annotations

import asyncio
from importlib import metadata

import faust
import pytest

from services.segmenter.upstream_fixes import (
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
    never = asyncio.Event()
    hand_over = asyncio.ensure_future(consumer.wait_first(never.wait(), consumer.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    assert not hand_over.done()
    await recovery.on_recovery_completed(1)
    assert found == [(False, False, True)]
