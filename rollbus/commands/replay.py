"""``rollbus replay`` and ``rollbus tail``: decode a topic's events and print them.

Replay reads up to the end offsets it saw when it started and exits; tail keeps following. The command
only: the reading is :mod:`rollbus.kafka.replay`, which the viewer uses too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime

from aiokafka import ConsumerRecord
from aiokafka.errors import KafkaError

from rollbus.codec import CodecError, Decoded
from rollbus.kafka.reach import DEFAULT_CONNECT_TIMEOUT, BrokerUnreachable, quiet_kafka_logs, require_broker
from rollbus.kafka.replay import ReadPlan, event_row, parse_since, read
from rollbus.kafka.topics import TopicsError, event_type_for, topic_name
from rollbus.settings import BusSettings, Field
from rollbus.tables import TableWriter, cells, header


def table_row(message: ConsumerRecord, decoded: Decoded | CodecError, event_type: str | None) -> list[str]:
    """The table row of one message on a topic holding ``event_type``."""
    key = message.key.decode(errors="replace") if message.key is not None else None
    place = (message.partition, message.offset, message.timestamp)
    if isinstance(decoded, CodecError):
        return cells(event_type, place, key, None, None, str(decoded))
    return cells(event_type, place, key, decoded.event_type, decoded.record)


def topic_event_type(topic: str) -> str | None:
    try:
        return event_type_for(topic)
    except TopicsError:
        return None


class ReplaySettings(BusSettings):
    """Settings of ``rollbus replay`` and ``rollbus tail`` (variables ``ROLLBUS_REPLAY_X_Y``); what to read
    (topic, start, key, limit, format) are the command's arguments."""

    model_config = BusSettings.scoped("replay")

    connect_timeout: float = Field(
        DEFAULT_CONNECT_TIMEOUT,
        gt=0,
        description="seconds to wait for an unreachable broker before giving up (replay) or saying so (tail)",
    )


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topic", help="topic to read (e.g. turns; with --namespace t42, t42.turns)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-beginning", action="store_true", help="start at the earliest offset")
    start.add_argument("--offset", type=int, help="start at this offset in every partition")
    start.add_argument("--since", type=parse_since, help="start at the first event at or after this ISO time")
    parser.add_argument("--key", help="only events of this rollout id (the Kafka key)")
    parser.add_argument("--limit", type=int, help="stop after this many events")
    parser.add_argument("--format", choices=("json", "table"), default="json", help="output format")
    parser.add_argument("--full", action="store_true", help="print token arrays and bytes in full")
    ReplaySettings.add_arguments(parser)


add_tail_arguments = add_replay_arguments
add_arguments = add_replay_arguments


def plan_from(args: argparse.Namespace, namespace: str = "") -> ReadPlan:
    """What the arguments ask to read; a bare rollbus topic name is taken in ``namespace``."""
    follow = getattr(args, "command", "replay") == "tail"
    topic = args.topic
    if namespace and not topic.startswith(f"{namespace}."):
        topic = topic_name(topic, namespace)
    start = "end" if follow else "beginning"
    if args.from_beginning:
        start = "beginning"
    elif args.offset is not None:
        start = "offset"
    elif args.since is not None:
        start = "since"
    return ReadPlan(
        topic, start, offset=args.offset or 0, since_ms=args.since or 0,
        key=args.key.encode() if args.key is not None else None, limit=args.limit, follow=follow,
    )  # fmt: skip


def where(plan: ReadPlan) -> str:
    """``turns from the beginning with key r-1``: what was read, in words, for messages on stderr."""
    start = {
        "beginning": "from the beginning",
        "end": "from the end",
        "offset": f"from offset {plan.offset}",
        "since": f"since {datetime.fromtimestamp(plan.since_ms / 1000, UTC).isoformat()}",
    }[plan.start]
    key = f" with key {plan.key.decode(errors='replace')}" if plan.key is not None else ""
    return f"{plan.topic} {start}{key}"


async def print_events(
    bootstrap_servers: str, plan: ReadPlan, output: str, full: bool, connect_timeout: float
) -> int:
    """Print ``plan``'s events as JSON lines or a table (aligned at the end for replay, row by row for
    tail). Everything that is not an event (waiting, nothing found, broker lost) goes to stderr."""
    if plan.follow:
        await require_broker(bootstrap_servers, connect_timeout)  # say "following" only once it is there
        say(f"following {where(plan)} on {bootstrap_servers}, Ctrl-C to stop")
    event_type = topic_event_type(plan.topic)
    table = TableWriter(sys.stdout, header(event_type), stream=plan.follow)
    count = 0
    async for message, decoded in read(bootstrap_servers, plan, connect_timeout, on_status=say):
        count += 1
        if output == "json":
            print(json.dumps(event_row(message, decoded, full), ensure_ascii=False), flush=True)
        else:
            table.add(table_row(message, decoded, event_type))
    table.close()
    if count == 0 and not plan.follow:
        say(f"no events in {where(plan)}")
    return 0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    settings = ReplaySettings.from_args(args)
    quiet_kafka_logs()
    plan = plan_from(args, settings.namespace)
    bootstrap = settings.bootstrap_servers
    try:
        return asyncio.run(print_events(bootstrap, plan, args.format, args.full, settings.connect_timeout))
    except (LookupError, BrokerUnreachable) as error:
        say(f"error: {error}")
        return 1
    except KafkaError as error:
        say(f"error: the broker at {bootstrap} failed while reading {plan.topic}: {error!r}")
        return 1
    except KeyboardInterrupt:
        return 130
