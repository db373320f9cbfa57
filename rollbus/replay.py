"""``rollbus replay`` and ``rollbus tail``: decode a topic's events and print them.

The bus is the source of truth, so reading it back must be easy: from the beginning, from an
offset, from a point in time, one rollout only. Replay reads up to the end offsets it saw when it
started and exits; tail keeps following. Neither joins a consumer group or commits anything, so
they never disturb the services. Token arrays are summarised (``[812 ids: 151644, 872, 198 … 9]``)
unless ``--full``; undecodable messages are shown with their error rather than stopping the read.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.partitioner import murmur2

from rollbus.codec import CodecError, Decoded, decode
from rollbus.config import DEFAULT_BOOTSTRAP, add_option
from rollbus.topics import describe

SUMMARY_EDGE = 3  # numbers shown from the start of a summarised array (plus the last one)


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
    bootstrap_servers: str, plan: ReadPlan
) -> AsyncIterator[tuple[ConsumerRecord, Decoded | CodecError]]:
    """Yield ``plan``'s messages with their decoding (or the decode error), in per-partition order."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=None, enable_auto_commit=False,
        isolation_level="read_committed", client_id="rollbus-replay",
    )  # fmt: skip
    await consumer.start()
    try:
        partitions = await _assign(consumer, bootstrap_servers, plan)
        end = None if plan.follow else await consumer.end_offsets(partitions)
        count = 0
        while end is None or await _behind(consumer, end):
            batch = await consumer.getmany(timeout_ms=500)
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
    numbers = range(counts[plan.topic])
    if plan.key is not None:  # every rollbus producer keys with the default partitioner
        numbers = [key_partition(plan.key, counts[plan.topic])]
    partitions = [TopicPartition(plan.topic, p) for p in numbers]
    consumer.assign(partitions)
    if plan.start == "beginning":
        await consumer.seek_to_beginning(*partitions)
    elif plan.start == "end":
        await consumer.seek_to_end(*partitions)
    elif plan.start == "offset":
        for tp in partitions:
            consumer.seek(tp, plan.offset)
    else:
        found = await consumer.offsets_for_times({tp: plan.since_ms for tp in partitions})
        await consumer.seek_to_end(*[tp for tp, at in found.items() if at is None])
        for tp, at in found.items():
            if at is not None:
                consumer.seek(tp, at.offset)
    return partitions


async def _behind(consumer: AIOKafkaConsumer, end: dict[TopicPartition, int]) -> bool:
    for tp, last in end.items():
        if await consumer.position(tp) < last:
            return True
    return False


# --- printing and CLI --------------------------------------------------------------------------


def record_summary(record: dict[str, Any], width: int = 100) -> str:
    """``rollout_id=r-1 turn_index=1 prompt_ids=[3 ids: …]`` cut to ``width``, for the table."""
    text = " ".join(f"{name}={value}" for name, value in record.items() if name != "schema_version")
    return text if len(text) <= width else text[: width - 1] + "…"


COLUMNS = (("p", 2), ("offset", 7), ("time (UTC)", 12), ("key", 12), ("type", 14), ("event", None))


def table_of(rows: list[dict[str, Any]], header: bool = True) -> Any:
    """A rich table, one line per event; fixed widths so rows printed one by one (tail) line up."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, show_header=header, expand=True)
    for name, width in COLUMNS:
        table.add_column(
            name, width=width, no_wrap=True, overflow="ellipsis", ratio=1 if width is None else None
        )
    for row in rows:
        event = row.get("event")
        kind = f"{event['type']} v{event['schema_version']}" if event else "[red]undecodable[/red]"
        what = record_summary(event["record"], width=400) if event else row["error"]
        time_of_day = row["timestamp"][11:23]
        table.add_row(str(row["partition"]), str(row["offset"]), time_of_day, row["key"] or "", kind, what)
    return table


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", help="topic to read (e.g. turns, or t42.turns in a namespace)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the earliest offset")
    start.add_argument("--offset", type=int, help="start at this offset in every partition")
    start.add_argument("--since", type=parse_since, help="start at the first event at or after this ISO time")
    parser.add_argument("--key", help="only events of this rollout id (the Kafka key)")
    parser.add_argument("--limit", type=int, help="stop after this many events")
    parser.add_argument("--format", choices=("json", "table"), default="json", help="output format")
    parser.add_argument("--full", action="store_true", help="print token arrays and bytes in full")
    add_option(
        parser, "--bootstrap-servers", default=DEFAULT_BOOTSTRAP, help="Kafka bootstrap servers", shared=True
    )


add_tail_arguments = add_replay_arguments
add_arguments = add_replay_arguments


def plan_from(args: argparse.Namespace) -> ReadPlan:
    follow = getattr(args, "command", "replay") == "tail"
    start = "end" if follow else "beginning"
    if args.from_beginning:
        start = "beginning"
    elif args.offset is not None:
        start = "offset"
    elif args.since is not None:
        start = "since"
    return ReadPlan(
        args.topic, start, offset=args.offset or 0, since_ms=args.since or 0,
        key=args.key.encode() if args.key is not None else None, limit=args.limit, follow=follow,
    )  # fmt: skip


async def print_events(bootstrap_servers: str, plan: ReadPlan, output: str, full: bool) -> int:
    """Print ``plan``'s events as JSON lines or a table (at the end for replay, row by row for tail)."""
    from rich.console import Console

    console = Console(highlight=False)
    rows: list[dict[str, Any]] = []
    async for message, decoded in read(bootstrap_servers, plan):
        row = event_row(message, decoded, full)
        if output == "json":
            print(json.dumps(row, ensure_ascii=False), flush=True)
        elif plan.follow:  # a table can't stream: one headerless row at a time after the first
            console.print(table_of([row], header=not rows))
            console.file.flush()
            rows = rows or [row]
        else:
            rows.append(row)
    if rows and not plan.follow:
        console.print(table_of(rows))
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(print_events(args.bootstrap_servers, plan_from(args), args.format, args.full))
    except LookupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
