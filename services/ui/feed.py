"""The edge: read every rollbus topic of a namespace into the read model, from the beginning, then follow.

Reading goes through :func:`rollbus.replay.read`: no consumer group, partitions assigned, nothing committed,
so the UI can start at any time, disturb no service, and catch up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiokafka import ConsumerRecord

from rollbus.codec import CodecError, Decoded
from rollbus.reach import BrokerUnreachable
from rollbus.replay import ReadPlan, read
from rollbus.services.ui.model import Entry, ReadModel, base_topic
from rollbus.topics import TOPICS, topic_name

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


async def feed(bootstrap: str, namespace: str, model: ReadModel, follow: bool = True,
               on_status: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Fold every topic of ``namespace`` into ``model``: until their ends when not ``follow``, else forever.
    A topic that is missing is told to ``on_status`` and skipped; a follower that finds no broker says so and
    tries again (it has read nothing yet: once reading, a lost broker is only reported, never raised)."""

    def say(line: str) -> None:
        if on_status is not None:
            on_status(line)

    async def one(base: str) -> None:
        while True:
            try:
                await read_topic(bootstrap, topic_name(base, namespace), follow, model.add)
                return
            except LookupError as missing:
                say(str(missing))
                return
            except BrokerUnreachable as unreachable:
                if not follow:
                    raise
                say(f"{unreachable}; trying again in {RETRY_S:g}s")
                await asyncio.sleep(RETRY_S)

    await asyncio.gather(*(one(spec.name) for spec in TOPICS))


async def rebuild(bootstrap: str, namespace: str) -> ReadModel:
    """A read model from scratch: every topic read to the end offsets it had when asked."""
    model = ReadModel()
    await feed(bootstrap, namespace, model, follow=False)
    return model
