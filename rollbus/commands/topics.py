"""``rollbus topics create|check|list``: the rollbus topics of a namespace, made or checked on a cluster.

The command only; what topics there are and how they are made and checked is :mod:`rollbus.kafka.topics`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from aiokafka.errors import KafkaError

from rollbus.kafka.reach import DEFAULT_CONNECT_TIMEOUT, BrokerUnreachable, quiet_kafka_logs, require_broker
from rollbus.kafka.topics import (
    DEFAULT_PARTITIONS,
    TOPICS,
    TopicsError,
    check_topics,
    create_topics,
    partition_counts,
    spec_for,
    topic_name,
)
from rollbus.settings import BusSettings, Field


class TopicsSettings(BusSettings):
    """Settings of ``rollbus topics`` (flags ``--x-y``, variables ``ROLLBUS_TOPICS_X_Y``)."""

    model_config = BusSettings.scoped("topics")

    partitions: int = Field(
        DEFAULT_PARTITIONS, ge=1, description="partition count shared by all rollout-keyed topics"
    )
    replication_factor: int = Field(1, ge=1, description="replicas per partition (1 locally)")
    connect_timeout: float = Field(
        DEFAULT_CONNECT_TIMEOUT, gt=0, description="seconds to wait for an unreachable broker, then give up"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("create", "check", "list"))
    TopicsSettings.add_arguments(parser)


def run(parsed: argparse.Namespace) -> int:
    args = TopicsSettings.from_args(parsed)
    quiet_kafka_logs()
    try:
        return asyncio.run(_run(parsed.action, args))
    except (TopicsError, BrokerUnreachable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KafkaError as error:
        print(f"error: the broker at {args.bootstrap_servers} failed: {error!r}", file=sys.stderr)
        return 1


async def _run(action: str, args: TopicsSettings) -> int:
    await require_broker(args.bootstrap_servers, args.connect_timeout)
    if action == "create":
        created = await create_topics(
            args.bootstrap_servers, args.partitions, args.namespace, args.replication_factor
        )
        print(f"created {', '.join(created)}" if created else "all topics already exist")
        await check_topics(args.bootstrap_servers, args.namespace)
    elif action == "check":
        counts = await check_topics(args.bootstrap_servers, args.namespace)
        keyed = next(n for name, n in counts.items() if spec_for(name).rollout_keyed)
        print(f"ok: {len(counts)} topics, rollout-keyed ones have {keyed} partitions")
    else:
        counts = await partition_counts(args.bootstrap_servers, args.namespace)
        for spec in TOPICS:
            count = counts.get(spec.name)
            state = f"{count} partitions" if count is not None else "MISSING"
            print(
                f"{topic_name(spec.name, args.namespace):<24} {state:<14} {spec.cleanup_policy:<8} {spec.key}"
            )
    return 0
