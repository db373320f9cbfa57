"""The UI's read model against a real broker: followed live while events arrive, it equals one rebuilt from
scratch afterwards, and reading commits nothing for anyone (no consumer group)."""

from __future__ import annotations

import asyncio
import contextlib
from functools import partial

from rollbus.kafka import clients
from rollbus.polling import wait_until_async
from rollbus.services.ui.feed import feed, rebuild
from rollbus.services.ui.model import ReadModel, overview
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
        assert {g[0] for g in await admin.list_consumer_groups()} == groups_before  # it joined no group


async def _at(model: ReadModel, count: int) -> bool:
    return model.events() >= count
