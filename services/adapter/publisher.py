"""Getting turns onto the bus without losing one.

Every turn is offered to the :class:`Publisher` before its response finishes. If the bus does not take
it, the record waits in a bounded in-memory backlog that a background task keeps retrying, in order. A
request reserves its backlog room *before* generating, so when the backlog is full the request is
refused up front (503 + retry-after) instead of a generated turn being dropped.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiokafka.errors import KafkaError

from rollbus.topics import topic_name

log = logging.getLogger(__name__)

#: what a failed delivery raises: broker errors, a dead connection, a delivery that timed out
DELIVERY_ERRORS: tuple[type[BaseException], ...] = (KafkaError, OSError, TimeoutError)


class Publisher(Protocol):
    """``rollbus.bus``'s producer as the adapter needs it: one awaited, acknowledged publish."""

    async def publish(self, topic: str, record: Mapping[str, Any], *, key: str) -> Any: ...


class BacklogFull(Exception):
    """The bus has been unreachable long enough that no more turns can be held."""


@dataclass(frozen=True)
class Pending:
    topic: str
    record: Mapping[str, Any]
    key: str


class Outbox:
    def __init__(
        self,
        publisher: Publisher,
        *,
        capacity: int = 1000,
        send_timeout: float = 5.0,
        retry_interval: float = 1.0,
        namespace: str = "",
    ) -> None:
        self.publisher = publisher
        self.namespace = namespace  # "" is the real topics; tests publish to ``t-....turns``
        self.capacity = capacity
        self.send_timeout = send_timeout
        self.retry_interval = retry_interval
        self.backlog: deque[Pending] = deque()
        self.reserved = 0
        self._drainer: asyncio.Task | None = None

    def reserve(self) -> None:
        """Claim room for one turn's records; raises :class:`BacklogFull` when there is none."""
        if len(self.backlog) + self.reserved >= self.capacity:
            raise BacklogFull(f"{len(self.backlog)} records wait for the bus (capacity {self.capacity})")
        self.reserved += 1

    def release(self) -> None:
        self.reserved = max(0, self.reserved - 1)

    async def publish(self, topic: str, record: Mapping[str, Any], key: str) -> bool:
        """Deliver now if the bus takes it (True), else keep it in the backlog (False). Never drops.

        ``topic`` is the base name (``turns``); the record goes to it in the outbox's namespace.
        """
        item = Pending(topic_name(topic, self.namespace), record, key)
        if not self.backlog and await self._send(item):
            return True
        self.backlog.append(item)
        self._ensure_drainer()
        return False

    async def _send(self, item: Pending) -> bool:
        try:
            await asyncio.wait_for(
                self.publisher.publish(item.topic, item.record, key=item.key), self.send_timeout
            )
        except DELIVERY_ERRORS as exc:
            log.warning(
                "bus did not take a %s record (%s: %s); keeping it", item.topic, type(exc).__name__, exc
            )
            return False
        return True

    def _ensure_drainer(self) -> None:
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="outbox-drain")

    async def _drain(self) -> None:
        while self.backlog:
            if await self._send(self.backlog[0]):
                self.backlog.popleft()
            else:
                await asyncio.sleep(self.retry_interval)

    async def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the backlog to reach the bus."""
        if not self.backlog:
            return
        self._ensure_drainer()
        assert self._drainer is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._drainer), timeout)
        except TimeoutError:
            log.error("%d records still wait for the bus after %.0f s", len(self.backlog), timeout)

    def spill(self, path: Path) -> int:
        """Write what never reached the bus to a JSON-lines file (for replay), and stop retrying."""
        if self._drainer is not None:
            self._drainer.cancel()
        if not self.backlog:
            return 0
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:
            for item in self.backlog:
                out.write(
                    json.dumps({"topic": item.topic, "key": item.key, "record": dict(item.record)}) + "\n"
                )
        count = len(self.backlog)
        self.backlog.clear()
        return count
