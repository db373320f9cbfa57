"""The edge: read every rollbus topic of a namespace into the read model, from the beginning, then follow.

Reading goes through :func:`rollbus.replay.read`: no consumer group, partitions assigned, nothing committed,
so the UI can start at any time, disturb no service, and catch up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiokafka import ConsumerRecord

from rollbus.codec import CodecError, Decoded
from rollbus.replay import ReadPlan, read
from rollbus.services.ui.model import Entry, ReadModel, base_topic
from rollbus.topics import TOPICS, topic_name


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
    A topic that is missing is told to ``on_status`` and skipped."""

    async def one(base: str) -> None:
        try:
            await read_topic(bootstrap, topic_name(base, namespace), follow, model.add)
        except LookupError as missing:
            if on_status is not None:
                on_status(str(missing))

    await asyncio.gather(*(one(spec.name) for spec in TOPICS))


async def rebuild(bootstrap: str, namespace: str) -> ReadModel:
    """A read model from scratch: every topic read to the end offsets it had when asked."""
    model = ReadModel()
    await feed(bootstrap, namespace, model, follow=False)
    return model
