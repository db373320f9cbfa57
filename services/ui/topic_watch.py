"""Waiting for topics that do not exist yet: the UI may start before ``rollbus up`` creates the topics, or
before a newer release adds one, and must read them once they appear, without a restart.

One look at the broker's topic list every ``interval`` seconds answers every waiter at once (not one admin
client per missing topic). A look that fails (no broker, a broker restarting) is only a look missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka.errors import KafkaError

from rollbus.kafka import clients

log = logging.getLogger("rollbus.ui")
TOPIC_POLL_S = 5.0  # seconds between looks at the topic list while some topic is awaited


class TopicWatch:
    """``await watch.appeared(name)`` returns once ``name`` is in the broker's topic list."""

    def __init__(self, bootstrap_servers: str, interval: float = TOPIC_POLL_S) -> None:
        self.bootstrap_servers, self.interval = bootstrap_servers, interval
        self.waiting: dict[str, asyncio.Event] = {}
        self._poller: asyncio.Task[None] | None = None

    async def appeared(self, topic: str) -> None:
        event = self.waiting.setdefault(topic, asyncio.Event())
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        await event.wait()

    async def _poll(self) -> None:
        while self.waiting:
            await asyncio.sleep(self.interval)
            present = await self._list()
            for topic in [t for t in self.waiting if t in present]:
                self.waiting.pop(topic).set()

    async def _list(self) -> set[str]:
        try:
            async with clients.admin(self.bootstrap_servers, client_id="rollbus-ui") as admin:
                return set(await admin.list_topics())
        except (KafkaError, OSError) as failed:
            log.debug("listing topics failed, looking again in %gs: %r", self.interval, failed)
            return set()

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
