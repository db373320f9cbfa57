"""The UI's read model against a real broker: followed live while events arrive, it equals one rebuilt from
scratch afterwards, and reading commits nothing for anyone (no consumer group); topics created after it
started are read once they appear."""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial

from rollbus.kafka import clients
from rollbus.kafka.topics import TOPICS, create_topics, topic_name
from rollbus.polling import wait_until_async
from rollbus.services.ui.feed import feed, rebuild
from rollbus.services.ui.model import ReadModel, overview, step_facts, trained_by
from tests.conftest import unique_namespace
from tests.segmenter_support import namespace_of, publish
from tests.ui_support import run_events


async def test_the_live_model_equals_one_rebuilt_from_scratch(
    kafka_bootstrap: str, topics: dict[str, str]
) -> None:
    events = run_events()
    half = len(events) // 2
    await publish(kafka_bootstrap, topics, events[:half])
    live = ReadModel()
    async with clients.admin(kafka_bootstrap, client_id="test-ui-live") as admin:
        groups_before = {g[0] for g in await admin.list_consumer_groups()}
        following = asyncio.create_task(feed(kafka_bootstrap, namespace_of(topics), live, follow=True))
        try:
            await wait_until_async(partial(_at, live, half), timeout=120, interval=0.2, what="the first half")
            await publish(kafka_bootstrap, topics, events[half:])  # arrives while the UI follows
            every = partial(_at, live, len(events))
            await wait_until_async(every, timeout=120, interval=0.2, what="every event")
        finally:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
        rebuilt = await rebuild(kafka_bootstrap, namespace_of(topics))
        assert rebuilt == live
        assert overview(rebuilt)["rollouts"]["finished"] == 4
        # who trained what comes from the trainer's facts on the bus, the same live and replayed
        assert [f["step"] for f in step_facts(rebuilt)] == [1]
        for model in (live, rebuilt):
            assert [e.record["step"] for e in trained_by(model, model.rollouts["r-0"])] == [1]  # type: ignore[index]
            assert trained_by(model, model.rollouts["r-2"]) == []
        assert {g[0] for g in await admin.list_consumer_groups()} == groups_before  # it joined no group


async def _at(model: ReadModel, count: int) -> bool:
    return model.events() >= count


async def test_topics_created_after_the_ui_started_are_read_once_they_appear(kafka_bootstrap: str) -> None:
    """The UI up before ``rollbus up`` made the topics: each is read from its beginning once it exists."""
    namespace, events, said = unique_namespace(), run_events(), []
    live = ReadModel()
    following = asyncio.create_task(
        feed(kafka_bootstrap, namespace, live, follow=True, on_status=said.append, topic_poll=0.2)
    )
    try:
        missing = f"topic {topic_name('train-steps', namespace)!r} does not exist; reading it once it appears"
        told = partial(_said, said, missing)
        await wait_until_async(told, timeout=120, interval=0.2, what="the UI saying a topic is missing")
        assert not following.done() and live.events() == 0
        await create_topics(kafka_bootstrap, 2, namespace)
        await publish(kafka_bootstrap, {s.name: topic_name(s.name, namespace) for s in TOPICS}, events)
        every = partial(_at, live, len(events))
        await wait_until_async(every, timeout=120, interval=0.2, what="every event of the topics made later")
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
    assert live == await rebuild(kafka_bootstrap, namespace)
    assert overview(live)["train_steps"] == 1


async def _said(lines: list[str], line: str) -> bool:
    return line in lines
