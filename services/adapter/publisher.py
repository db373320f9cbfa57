"""Getting turns onto the bus: nothing lost, nothing sent twice, nothing wedged.

A turn's records are encoded and size-checked when they are queued (:meth:`Outbox.enqueue`, which does
not await), so a record the bus could never take fails its request before the turn is committed, and
the turn is committed in the same step as it is queued. One background task sends the backlog in
order, one acknowledged record at a time, with no timeout of its own: the idempotent producer retries
inside its ``request_timeout`` (a setting) and cancelling a send would not stop it, only duplicate it.

What a send raises decides what happens next:

* transient (the error's ``retriable`` flag, a dead connection, an expired batch): the record stays at
  the head and is tried again after ``retry_interval``;
* permanent (too large, refused, anything else): it goes to ``dead-letters`` with its bytes and the
  error, or, if the bus refuses even that, to ``adapter-rejected.jsonl`` in the state directory; the
  drain goes on with the next record.

The backlog is bounded in records and bytes: a request reserves room for a turn's records before it
generates, and is refused up front (503 + retry-after) when there is none. What is still queued at
shutdown is spilled to ``adapter-unpublished.jsonl``; the next start queues it again (:meth:`recover`)
ahead of any new turn and deletes it once the bus has it. A crash during that replay can send a record
twice, which readers of turns drop as an exact duplicate; nothing is lost.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiokafka.errors import KafkaError, KafkaTimeoutError

from rollbus.codec import encode, encode_event
from rollbus.events import DeadLetterEvent
from rollbus.kafka.bus import Outgoing
from rollbus.kafka.topics import dead_letters_for, spec_for, topic_name

log = logging.getLogger(__name__)

RECORDS_PER_TURN = 4  # frozen + opened + turn + a side chain's frozen: what one turn may queue
SPILL_FILE = "adapter-unpublished.jsonl"
REJECTED_FILE = "adapter-rejected.jsonl"
_REPLAYING = "adapter-replaying-*.jsonl"  # spill files taken by a start, deleted once delivered


class BytePublisher(Protocol):
    """What the adapter needs of ``rollbus.kafka.bus.Publisher``: send encoded bytes, return once
    acknowledged."""

    async def publish_bytes(self, topic: str, value: bytes, *, key: str | bytes | None) -> Any: ...


class BacklogFull(Exception):
    """The bus has been unreachable long enough that no more turns can be held."""


class RecordTooLarge(ValueError):
    """An encoded record over its topic's size limit: the bus would refuse it for good."""


@dataclass
class Pending:
    topic: str  # the full (namespaced) topic name
    value: bytes
    key: str
    delivered: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def retriable(error: BaseException) -> bool:
    """Whether sending the same record again can succeed."""
    if isinstance(error, KafkaTimeoutError):  # a batch expired while the broker was away
        return True
    if isinstance(error, KafkaError):
        return bool(error.retriable)
    return isinstance(error, OSError | TimeoutError)


class Outbox:
    def __init__(
        self,
        publisher: BytePublisher,
        *,
        capacity: int = 1000,
        capacity_bytes: int = 256 * 1024 * 1024,
        retry_interval: float = 1.0,
        namespace: str = "",
        state_dir: Path | None = None,
        max_event_bytes: int | None = None,
    ) -> None:
        self.publisher = publisher
        self.namespace = namespace  # "" is the real topics; tests publish to ``t-....turns``
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.retry_interval = retry_interval
        self.state_dir = state_dir  # where spill and rejected files go (None: nowhere, log only)
        self.max_event_bytes = max_event_bytes  # None: each topic's own limit
        self.backlog: deque[Pending] = deque()
        self.backlog_bytes = 0
        self.reserved = 0
        self.dead_lettered = 0
        self._drainer: asyncio.Task | None = None
        self._replaying: dict[Path, asyncio.Task] = {}  # spill file being replayed -> its watcher

    def reserve(self) -> None:
        """Claim room for one turn's records; raises :class:`BacklogFull` when there is none."""
        queued = len(self.backlog) + self.reserved * RECORDS_PER_TURN
        if queued >= self.capacity or self.backlog_bytes >= self.capacity_bytes:
            raise BacklogFull(
                f"{len(self.backlog)} records ({self.backlog_bytes} bytes) wait for the bus "
                f"(capacity {self.capacity} records, {self.capacity_bytes} bytes)"
            )
        self.reserved += 1

    def release(self) -> None:
        self.reserved = max(0, self.reserved - 1)

    def enqueue(self, records: Iterable[tuple[str, Outgoing, str]]) -> asyncio.Future[None]:
        """Encode ``(topic, record, key)`` records and queue them in order; never awaits.

        All are encoded before any is queued, so a record that cannot be encoded or is too large
        raises here with nothing queued. Returns the last record's delivery (done once the bus
        acknowledged it or it was dead-lettered). ``topic`` is the base name (``turns``).
        """
        items = [self._encoded(topic, record, key) for topic, record, key in records]
        for item in items:
            self._queue(item)
        last = items[-1].delivered if items else asyncio.get_running_loop().create_future()
        if not items:
            last.set_result(None)
        return last

    def _encoded(self, topic: str, record: Outgoing, key: str) -> Pending:
        spec = spec_for(topic)
        value = encode(spec.event_type, record)
        limit = self.max_event_bytes or spec.max_message_bytes
        if len(value) > limit:
            raise RecordTooLarge(f"{topic} record is {len(value)} bytes, over the bus limit of {limit}")
        return Pending(topic_name(topic, self.namespace), value, key)

    def _queue(self, item: Pending) -> None:
        self.backlog.append(item)
        self.backlog_bytes += len(item.value)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="outbox-drain")

    async def settled(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every record queued so far to be dealt with; never cancels one."""
        if not self.backlog:
            return True
        done, _ = await asyncio.wait({self.backlog[-1].delivered}, timeout=timeout)
        return bool(done)

    async def publish(self, topic: str, record: Outgoing, key: str) -> None:
        """Queue one record and wait until the bus has it (or it was dead-lettered)."""
        await asyncio.shield(self.enqueue([(topic, record, key)]))

    async def _drain(self) -> None:
        while self.backlog:
            item = self.backlog[0]
            if not await self._send(item):
                await asyncio.sleep(self.retry_interval)
                continue
            self.backlog.popleft()
            self.backlog_bytes -= len(item.value)
            if not item.delivered.done():
                item.delivered.set_result(None)

    async def _send(self, item: Pending) -> bool:
        """True once the record is dealt with (delivered or given up on); False to try it again."""
        try:
            await self.publisher.publish_bytes(item.topic, item.value, key=item.key)
        except Exception as exc:  # noqa: BLE001 - sorted into transient and permanent right here
            if retriable(exc):
                log.warning(
                    "bus did not take a %s record (%s: %s); retrying", item.topic, type(exc).__name__, exc
                )
                return False
            return await self._give_up(item, exc)
        return True

    async def _give_up(self, item: Pending, error: Exception) -> bool:
        """A record the bus refuses for good: to dead-letters, else to the rejected file."""
        log.error("the bus refused a %s record for good (%s: %s)", item.topic, type(error).__name__, error)
        letter = DeadLetterEvent(
            source_topic=item.topic, partition=-1, offset=-1,  # never reached its topic
            key=item.key.encode(), value=item.value, error=f"{type(error).__name__}: {error}",
            service="adapter", at=int(time.time() * 1000),
        )  # fmt: skip
        target = dead_letters_for(item.topic)
        try:
            value = encode_event(letter)
            await self.publisher.publish_bytes(target, value, key=item.key)
        except Exception as exc:  # noqa: BLE001
            if retriable(exc):
                return False
            self._write(REJECTED_FILE, [item], error=f"{type(error).__name__}: {error}")
        self.dead_lettered += 1
        return True

    async def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the backlog to reach the bus."""
        if not self.backlog or self._drainer is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._drainer), timeout)
        except TimeoutError:
            log.error("%d records still wait for the bus after %.0f s", len(self.backlog), timeout)

    def spill(self, path: Path | None = None) -> int:
        """Write what never reached the bus to the spill file (the next start sends it), stop retrying."""
        if self._drainer is not None:
            self._drainer.cancel()
        count = len(self.backlog)
        if count:
            self._write(SPILL_FILE, list(self.backlog), path=path)
            self.backlog.clear()
            self.backlog_bytes = 0
        for replayed, watcher in self._replaying.items():  # what was not delivered is in the new spill
            watcher.cancel()
            replayed.unlink(missing_ok=True)
        self._replaying.clear()
        return count

    def _write(
        self, name: str, items: list[Pending], *, error: str | None = None, path: Path | None = None
    ) -> None:
        target = path or (self.state_dir / name if self.state_dir is not None else None)
        if target is None:
            log.error("%d records are lost: the outbox has no state directory", len(items))
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a") as out:
            for item in items:
                line = {"topic": item.topic, "key": item.key, "value": base64.b64encode(item.value).decode()}
                out.write(json.dumps({**line, "error": error} if error else line) + "\n")

    def recover(self) -> int:
        """Queue what earlier runs spilled (before any new turn); each file goes once delivered."""
        if self.state_dir is None:
            return 0
        spilled = self.state_dir / SPILL_FILE
        if spilled.exists():
            spilled.rename(self.state_dir / _REPLAYING.replace("*", uuid.uuid4().hex))
        count = 0
        for path in sorted(self.state_dir.glob(_REPLAYING)):
            items = [_pending(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
            for item in items:
                self._queue(item)
            deliveries = [item.delivered for item in items]
            self._replaying[path] = asyncio.create_task(self._forget_when_sent(path, deliveries))
            count += len(items)
        return count

    async def _forget_when_sent(self, path: Path, deliveries: list[asyncio.Future[None]]) -> None:
        if deliveries:
            await asyncio.wait(deliveries)
        if self._replaying.pop(path, None) is not None:
            path.unlink(missing_ok=True)


def _pending(line: dict[str, Any]) -> Pending:
    """A spilled record; files of older adapters hold the record itself rather than its bytes."""
    if "value" in line:
        return Pending(line["topic"], base64.b64decode(line["value"]), line["key"])
    return Pending(line["topic"], encode(spec_for(line["topic"]).event_type, line["record"]), line["key"])
