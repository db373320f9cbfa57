"""Reading a topic's events back, decoded: the reader under ``rollbus replay`` / ``rollbus tail``
(:mod:`rollbus.commands.replay`), the viewer, the regrader and the adapter's restore.

The bus is the source of truth, so reading it back must be easy: from the beginning, from an
offset, from a point in time, one rollout only; up to the end offsets seen at the start, or following.
No consumer group is joined and nothing committed, so a reader never disturbs the services. Token arrays
are summarised for people (``[812 ids: 151644, 872, 198 … 9]``) unless asked in full; undecodable messages
come with their error rather than stopping the read.
"""

from __future__ import annotations

import argparse
import base64
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.partitioner import murmur2

from rollbus.codec import CodecError, Decoded, decode
from rollbus.kafka import clients
from rollbus.kafka.reach import (
    DEFAULT_CONNECT_TIMEOUT,
    BrokerUnreachable,
    reachable,
    require_broker,
)
from rollbus.kafka.read import behind, from_beginning
from rollbus.kafka.topics import describe

SUMMARY_EDGE = 3  # numbers shown from the start of a summarised array (plus the last one)
PROBE_EVERY = 2.0  # idle seconds between checks that the broker is still there


@dataclass(frozen=True)
class ReadPlan:
    """What to read: where each partition starts, which key, how many, and whether to follow."""

    topic: str
    start: str = "beginning"  # beginning | end | offset | since
    offset: int = 0
    since_ms: int = 0
    key: bytes | None = None
    limit: int | None = None
    follow: bool = False


# --- pure formatting ---------------------------------------------------------------------------


def _number(value: Any) -> str:
    return repr(round(value, 4)) if isinstance(value, float) else str(value)


def _numbers(values: list[Any], noun: str) -> str:
    """``[812 ids: 151644, 872, 198 … 9]``: the count, the first few and the last."""
    shown = ", ".join(_number(v) for v in values[:SUMMARY_EDGE])
    if len(values) > SUMMARY_EDGE:
        shown += f" … {_number(values[-1])}"
    return f"[{len(values)} {noun}: {shown}]"


def summarise(value: Any, full: bool = False) -> Any:
    """``value`` made printable as JSON: long number arrays summarised unless ``full``; bytes as base64
    when ``full``, else summarised like numbers."""
    if isinstance(value, dict):
        return {name: summarise(item, full) for name, item in value.items()}
    if isinstance(value, bytes | bytearray):
        return base64.b64encode(value).decode() if full else _numbers(list(value), "bytes")
    if isinstance(value, list):
        if not full and len(value) > SUMMARY_EDGE + 1 and all(isinstance(v, int | float) for v in value):
            noun = "ids" if all(isinstance(v, int) for v in value) else "values"
            return _numbers(value, noun)
        return [summarise(item, full) for item in value]
    return value


def event_row(message: ConsumerRecord, decoded: Decoded | CodecError, full: bool = False) -> dict[str, Any]:
    """One printable row: where the message is, its key, and its event (or why it is undecodable)."""
    row: dict[str, Any] = {
        "topic": message.topic,
        "partition": message.partition,
        "offset": message.offset,
        "timestamp": datetime.fromtimestamp(message.timestamp / 1000, UTC).isoformat(timespec="milliseconds"),
        "key": message.key.decode(errors="replace") if message.key is not None else None,
    }
    if isinstance(decoded, CodecError):
        row["error"] = str(decoded)
    else:
        row["event"] = {
            "type": decoded.event_type,
            "schema_version": decoded.schema_version,
            "record": summarise(decoded.record, full),
        }
    return row


def parse_since(text: str) -> int:
    """ISO-8601 time -> epoch milliseconds; a time without zone is taken as UTC."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--since wants an ISO time like 2026-01-31T12:00:00Z, not {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(moment.timestamp() * 1000)


# --- reading -----------------------------------------------------------------------------------


async def read(
    bootstrap_servers: str,
    plan: ReadPlan,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    on_status: Callable[[str], None] | None = None,
) -> AsyncIterator[tuple[ConsumerRecord, Decoded | CodecError]]:
    """Yield ``plan``'s messages with their decoding (or the decode error), in per-partition order.

    :class:`BrokerUnreachable` if no broker answers within ``connect_timeout`` seconds, at the start or
    (replay) when it goes away mid-read; a follower instead tells ``on_status`` once that it lost the
    broker and once that it is back, and keeps waiting."""
    await require_broker(bootstrap_servers, connect_timeout)
    consumer = clients.consumer(
        bootstrap_servers, client_id="rollbus-replay", isolation_level="read_committed"
    )
    try:
        await consumer.start()
        partitions = await _assign(consumer, bootstrap_servers, plan)
        end = None if plan.follow else await consumer.end_offsets(partitions)
        watch = BrokerWatch(bootstrap_servers, connect_timeout, plan.follow, on_status)
        count = 0
        while end is None or await behind(consumer, end):
            batch = await consumer.getmany(timeout_ms=500)
            if not batch:
                await watch.idle()
                continue
            await watch.alive()
            for message in (m for messages in batch.values() for m in messages):
                if plan.key is not None and message.key != plan.key:
                    continue
                if (
                    end is not None
                    and message.offset >= end[TopicPartition(message.topic, message.partition)]
                ):
                    continue
                yield message, _decode(message.value)
                count += 1
                if plan.limit is not None and count >= plan.limit:
                    return
    finally:
        await consumer.stop()


@dataclass
class BrokerWatch:
    """Notices, while a read is idle, that the broker went away (aiokafka itself only retries, silently
    now): probes every ``PROBE_EVERY`` idle seconds; a reader gives up after ``timeout`` seconds
    without the broker, a follower reports the loss once and the return once."""

    bootstrap_servers: str
    timeout: float
    follow: bool
    on_status: Callable[[str], None] | None
    lost_at: float | None = None
    probed_at: float = field(default_factory=time.monotonic)

    async def idle(self) -> None:
        if time.monotonic() - self.probed_at < PROBE_EVERY:
            return
        self.probed_at = time.monotonic()
        if await reachable(self.bootstrap_servers, min(self.timeout, PROBE_EVERY)):
            await self.alive()
            return
        if self.lost_at is None:
            self.lost_at = time.monotonic()
            if self.follow:
                self._say(f"lost the broker at {self.bootstrap_servers}; retrying quietly until it is back")
        elif not self.follow and time.monotonic() - self.lost_at >= self.timeout:
            raise BrokerUnreachable(self.bootstrap_servers, self.timeout)

    async def alive(self) -> None:
        if self.lost_at is not None:
            self.lost_at = None
            if self.follow:
                self._say(f"the broker at {self.bootstrap_servers} is back; following again")

    def _say(self, line: str) -> None:
        if self.on_status is not None:
            self.on_status(line)


def _decode(value: bytes | None) -> Decoded | CodecError:
    try:
        return decode(value or b"")
    except CodecError as error:
        return error


def key_partition(key: bytes, partitions: int) -> int:
    """Where Kafka's default partitioner (Java's and aiokafka's alike) puts ``key``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


async def _assign(consumer: AIOKafkaConsumer, bootstrap_servers: str, plan: ReadPlan) -> list[TopicPartition]:
    """Assign the topic's partitions (only the key's one when filtering by key) and seek each to
    where ``plan`` starts."""
    counts = await describe(bootstrap_servers, [plan.topic])
    if plan.topic not in counts:
        raise LookupError(f"topic {plan.topic!r} does not exist")
    numbers: Sequence[int] = range(counts[plan.topic])
    if plan.key is not None:  # every rollbus producer keys with the default partitioner
        numbers = [key_partition(plan.key, counts[plan.topic])]
    partitions = [TopicPartition(plan.topic, p) for p in numbers]
    if plan.start == "beginning":
        await from_beginning(consumer, partitions)
        return partitions
    consumer.assign(partitions)
    # explicit offsets: seek_to_end() right after assign() races the consumer's own offset reset (see
    # rollbus.kafka.read)
    if plan.start == "end":
        for tp, offset in (await consumer.end_offsets(partitions)).items():
            consumer.seek(tp, offset)
    elif plan.start == "offset":
        for tp in partitions:
            consumer.seek(tp, plan.offset)
    else:
        found = await consumer.offsets_for_times({tp: plan.since_ms for tp in partitions})
        ends = await consumer.end_offsets(partitions)
        for tp, at in found.items():
            consumer.seek(tp, ends[tp] if at is None else at.offset)
    return partitions
