"""``rollbus rebuild segments --into TOPIC``: the raw topics replayed through the segmenter's logic.

Event sourcing's promise, kept: ``segments`` is derived data. This reads ``turns``, ``sessions``, ``diffs``,
``rewards`` and the segmenter's ``segmenter-ticks`` from the beginning to their current ends, one partition
number at a time: each partition's topics, merged by broker timestamp (each topic keeping its own order, as
the live worker sees it), stream through :class:`rollbus.services.segmenter.segmentation.Segmenter` over plain
dicts, and the segments go to a fresh topic as they are cut, so memory holds one partition's rollouts, never
the whole log. Segment ids and contents are deterministic, so the result equals the live topic after
deduplication by id, whatever crashes the live segmenter went through.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import TopicPartition
from pydantic import Field

from rollbus.codec import CodecError
from rollbus.kafka.bus import Publisher
from rollbus.kafka.read import read_merged
from rollbus.kafka.topics import (
    MAX_EVENT_BYTES,
    TopicsError,
    check_topics,
    create_fresh,
    describe,
    spec_for,
    topic_name,
)
from rollbus.services.segmenter.app import INPUTS, TICKS
from rollbus.services.segmenter.segmentation import Segmenter, decode_fact
from rollbus.services.segmenter.settings import SegmenterSettings


class RebuildSettings(SegmenterSettings):
    """Settings of `rollbus rebuild segments`: the segmenter's, plus where the rebuilt segments go."""

    model_config = SegmenterSettings.scoped("rebuild")
    into: str = Field(..., min_length=1, description="fresh topic to write the rebuilt segments to")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["segments"], help="the derived topic to rebuild")
    RebuildSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = RebuildSettings.from_args(args)
    try:
        summary = asyncio.run(rebuild(settings))
    except TopicsError as error:
        print(f"rollbus rebuild: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary, sort_keys=True))
    return 0


async def rebuild(settings: RebuildSettings, into: str | None = None) -> dict[str, Any]:
    """Replay, cut, publish into ``into`` (default ``settings.into``); returns counts."""
    into = into or settings.into
    counts = await check_topics(settings.bootstrap_servers, settings.namespace)
    partitions = next(n for name, n in counts.items() if spec_for(name).rollout_keyed)
    await create_fresh(settings.bootstrap_servers, into, partitions, like="segments")
    names = [topic_name(t, settings.namespace) for t in (*INPUTS, TICKS)]
    present = await describe(settings.bootstrap_servers, names)
    totals: Counter[str] = Counter()
    published = 0
    async with Publisher(
        settings.bootstrap_servers, client_id="rollbus-rebuild", max_event_bytes=MAX_EVENT_BYTES
    ) as out:
        for partition in range(max(present.values(), default=0)):
            # a rollout lives on one partition number of every topic: its state never outlives the partition
            segmenter = Segmenter({}, {}, settings.options())
            tps = [TopicPartition(t, partition) for t in names if partition < present.get(t, 0)]
            async for rollout_id, segment in replay_partition(segmenter, partition, tps, settings):
                await out.publish_bytes(into, segment, key=rollout_id)
                published += 1
            totals.update(segmenter.counts)
    return {"into": into, "segments": published, **totals}


async def replay_partition(
    segmenter: Segmenter, partition: int, tps: list[TopicPartition], settings: SegmenterSettings
) -> AsyncIterator[tuple[str, bytes]]:
    """The partition's messages in timestamp order (each topic's order kept) through the state machine:
    (rollout id, encoded segment) of every segment cut, as the worker publishes them."""
    ticks = topic_name(TICKS, settings.namespace)
    async for message in read_merged(
        settings.bootstrap_servers, tps, client_id="rollbus-rebuild",
        max_partition_fetch_bytes=MAX_EVENT_BYTES + 64 * 1024, fetch_max_bytes=4 * MAX_EVENT_BYTES,
    ):  # fmt: skip
        if message.topic == ticks:
            try:
                segmenter.tick(int(json.loads(message.value)["now"]), partition)
            except (ValueError, KeyError, TypeError):
                pass
            continue
        try:
            fact = decode_fact(message.topic, message.value, message.key, message.timestamp)
        except CodecError:
            segmenter.count("poison")
            continue
        outcome = segmenter.handle(fact, message.value, partition)
        for segment in outcome.messages:
            yield outcome.rollout_id, segment
        segmenter.settle(outcome)
