"""The edge: read every rollbus topic of a namespace into the read model, from the beginning, then follow.

Reading goes through :func:`~rollbus.kafka.replay.read`: no consumer group, partitions assigned, nothing
committed, so the UI can start at any time, disturb no service, and catch up. A topic created after the UI
started is read from its beginning once it appears (:mod:`rollbus.services.ui.topic_watch`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiokafka import ConsumerRecord

from rollbus.codec import CodecError, Decoded
from rollbus.kafka.reach import BrokerUnreachable
from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import TOPICS, topic_name
from rollbus.services.ui.model import Entry, ReadModel, base_topic
from rollbus.services.ui.topic_watch import TOPIC_POLL_S, TopicWatch

RETRY_S = 5.0  # seconds between tries while no broker answers


def entry_of(message: ConsumerRecord, decoded: Decoded | CodecError) -> Entry:
    key = message.key.decode(errors="replace") if message.key is not None else None
    place = (base_topic(message.topic), message.partition, message.offset, message.timestamp, key)
    if isinstance(decoded, CodecError):
        return Entry(*place, event_type=None, record=None, error=str(decoded))
    return Entry(*place, event_type=decoded.event_type, record=decoded.record)


async def read_topic(bootstrap: str, topic: str, follow: bool, add: Callable[[Entry], None]) -> None:
    async for message, decoded in read(bootstrap, ReadPlan(topic, "beginning", follow=follow)):
        add(entry_of(message, decoded))


async def feed(
    bootstrap: str, namespace: str, model: ReadModel, follow: bool = True,
    on_status: Callable[[str], None] | None = None, topic_poll: float = TOPIC_POLL_S,
) -> None:  # fmt: skip
    """Fold every topic of ``namespace`` into ``model``: until their ends when not ``follow``, else forever.
    A missing topic is told to ``on_status``: a rebuild skips it, a follower reads it once it appears (the
    topic list is looked at every ``topic_poll`` seconds). A follower that finds no broker says so and tries
    again (it has read nothing yet: once reading, a lost broker is only reported, never raised)."""

    def say(line: str) -> None:
        if on_status is not None:
            on_status(line)

    watch = TopicWatch(bootstrap, topic_poll)

    async def one(base: str) -> None:
        topic = topic_name(base, namespace)
        while True:
            try:
                await read_topic(bootstrap, topic, follow, model.add)
                return
            except LookupError as missing:
                if not follow:
                    say(str(missing))
                    return
                say(f"{missing}; reading it once it appears")
                await watch.appeared(topic)
                say(f"topic {topic!r} appeared; reading it")
            except BrokerUnreachable as unreachable:
                if not follow:
                    raise
                say(f"{unreachable}; trying again in {RETRY_S:g}s")
                await asyncio.sleep(RETRY_S)

    try:
        await asyncio.gather(*(one(spec.name) for spec in TOPICS))
    finally:
        await watch.close()


async def rebuild(bootstrap: str, namespace: str) -> ReadModel:
    """A read model from scratch: every topic read to the end offsets it had when asked."""
    model = ReadModel()
    await feed(bootstrap, namespace, model, follow=False)
    return model
