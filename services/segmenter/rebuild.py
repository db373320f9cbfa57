"""``rollbus rebuild segments --into TOPIC``: the raw topics replayed through the segmenter's logic.

Event sourcing's promise, kept: ``segments`` is derived data. This reads ``turns``, ``sessions``, ``diffs``,
``rewards`` and the segmenter's ``segmenter-ticks`` from the beginning to their current ends, partition by
partition, merges each partition's topics by broker timestamp (each topic keeping its own order, as the live
worker sees it), runs them through :class:`rollbus.segmentation.Segmenter` over plain dicts, and publishes the
segments to a fresh topic. Segment ids and contents are deterministic, so the result equals the live topic
after deduplication by id, whatever crashes the live segmenter went through.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import sys
from collections.abc import Iterator
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from pydantic import Field

from rollbus.bus import Publisher
from rollbus.codec import CodecError
from rollbus.kafka.read import read_partitions
from rollbus.segmentation import Segmenter, decode_fact
from rollbus.services.segmenter.app import INPUTS, TICKS
from rollbus.services.segmenter.settings import SegmenterSettings
from rollbus.topics import (
    MAX_EVENT_BYTES,
    TopicsError,
    check_topics,
    create_fresh,
    describe,
    spec_for,
    topic_name,
)

Messages = dict[int, list[list[ConsumerRecord]]]  # partition -> one ordered list per topic


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


async def rebuild(settings: SegmenterSettings, into: str | None = None) -> dict[str, Any]:
    """Replay, cut, publish into ``into`` (default ``settings.into``); returns counts."""
    into = into or settings.into  # type: ignore[attr-defined]
    counts = await check_topics(settings.bootstrap_servers, settings.namespace)
    partitions = next(n for name, n in counts.items() if spec_for(name).rollout_keyed)
    await create_fresh(settings.bootstrap_servers, into, partitions, like="segments")
    messages = await read_raw(settings)
    segmenter = Segmenter({}, {}, settings.options())
    segments = [s for p in sorted(messages) for s in replay_partition(segmenter, p, messages[p], settings)]
    async with Publisher(
        settings.bootstrap_servers, client_id="rollbus-rebuild", max_event_bytes=MAX_EVENT_BYTES
    ) as out:
        for rollout_id, segment in segments:
            await out.publish_bytes(into, segment, key=rollout_id)
    return {"into": into, "segments": len(segments), **segmenter.counts}


def replay_partition(
    segmenter: Segmenter, partition: int, streams: list[list[ConsumerRecord]], settings: SegmenterSettings
) -> Iterator[tuple[str, bytes]]:
    """The partition's messages in timestamp order (each topic's order kept) through the state machine:
    (rollout id, encoded segment) of every segment cut, as the worker publishes them."""
    ticks = topic_name(TICKS, settings.namespace)
    for message in heapq.merge(*streams, key=lambda m: m.timestamp):
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


async def read_raw(settings: SegmenterSettings) -> Messages:
    """Every message of the inputs and ticks up to their current ends, grouped by partition number."""
    names = [topic_name(t, settings.namespace) for t in (*INPUTS, TICKS)]
    present = await describe(settings.bootstrap_servers, names)
    tps = [TopicPartition(t, p) for t in names if t in present for p in range(present[t])]
    by_tp: dict[TopicPartition, list[ConsumerRecord]] = {tp: [] for tp in tps}
    async for record in read_partitions(
        settings.bootstrap_servers, tps, client_id="rollbus-rebuild",
        max_partition_fetch_bytes=MAX_EVENT_BYTES + 64 * 1024, fetch_max_bytes=4 * MAX_EVENT_BYTES,
    ):  # fmt: skip
        by_tp[TopicPartition(record.topic, record.partition)].append(record)
    grouped: Messages = {}
    for tp, records in by_tp.items():
        grouped.setdefault(tp.partition, []).append(records)
    return grouped
