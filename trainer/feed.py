"""The trainer's edges: segments in (manual commits), the latest version on ``policy``, weight pushes.

The trainer cannot use :class:`~rollbus.kafka.bus.EventConsumer`, which commits after each batch: a segment is
only done once the step that trains its whole group is checkpointed, and segments of incomplete groups may
wait across many polls. So it tracks positions itself and commits, after each durable checkpoint, the first
offset per partition that still has an untrained segment behind it.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from aiokafka import ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import OffsetAndMetadata

from rollbus.kafka import clients
from rollbus.kafka.bus import decode_message
from rollbus.kafka.read import read_partitions

log = logging.getLogger("rollbus.trainer")


class SegmentFeed:
    """A consumer-group member on ``segments`` that never commits by itself."""

    def __init__(
        self, bootstrap_servers: str, topic: str, consumer_group: str, *, max_poll_interval_ms: int,
        session_timeout_ms: int,
    ) -> None:  # fmt: skip
        self._consumer = clients.consumer(
            bootstrap_servers,
            topic,
            consumer_group=consumer_group,
            client_id="trainer",
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_poll_interval_ms=max_poll_interval_ms,
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=max(session_timeout_ms // 10, 100),
        )

    async def __aenter__(self) -> SegmentFeed:
        await self._consumer.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._consumer.stop()

    async def fetch(self, timeout_ms: int) -> list[ConsumerRecord]:
        """The next messages, partition by partition (in offset order within each)."""
        batch = await self._consumer.getmany(timeout_ms=timeout_ms)
        return [m for tp in sorted(batch, key=lambda tp: tp.partition) for m in batch[tp]]

    async def commit(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commit ``offsets``; False if a rebalance took the partitions meanwhile (the group redelivers from
        the last commit, which the trainer's dedupe absorbs; the next step's commit covers these offsets)."""
        if not offsets:
            return True
        try:
            await self._consumer.commit({tp: OffsetAndMetadata(n, "") for tp, n in offsets.items()})
        except (CommitFailedError, IllegalStateError) as err:
            log.warning("offset commit failed after a rebalance (%s); the next step commits again", err)
            return False
        return True


async def latest_policy_version(bootstrap_servers: str, topic: str, max_event_bytes: int) -> int | None:
    """The highest version ever published on ``policy`` (a compacted, single-partition topic), or None."""
    latest: int | None = None
    async for message in read_partitions(bootstrap_servers, [TopicPartition(topic, 0)], client_id="trainer"):
        version = int(decode_message(message, max_event_bytes).record["version"])
        latest = version if latest is None else max(latest, version)
    return latest


async def push_weights(
    engine_url: str, path: str, version: int, *, api_key: str | None, timeout: float, retries: int
) -> bool:
    """Ask the engine to load ``path`` as ``version``; False (logged) if it still refuses after retries.

    A refused push loses nothing: the version is on ``policy`` and on disk, and the next push supersedes it.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model_path": path, "weight_version": str(version)}
    async with httpx.AsyncClient(timeout=timeout) as client:
        for attempt in range(retries + 1):
            try:
                url = f"{engine_url}/update_weights_from_disk"
                response = await client.post(url, json=body, headers=headers)
                if response.status_code == 200 and response.json().get("success"):
                    return True
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as err:
                problem = f"{type(err).__name__}: {err}"
            log.warning("engine refused weights v%d (attempt %d): %s", version, attempt + 1, problem)
            if response_is_final(problem):
                break
            await asyncio.sleep(min(2.0**attempt, 30.0))
    return False


def response_is_final(problem: str) -> bool:
    """An auth failure will not fix itself by retrying."""
    return problem.startswith(("HTTP 401", "HTTP 403"))
