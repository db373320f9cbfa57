"""Decode or dead-letter: the one way every consumer loop (the bus's
:class:`~rollbus.kafka.bus.EventConsumer`, the in-flight consumer, the trainer, the segmenter's Faust agent)
turns a message into its event, or, when the message is poison for it, forwards it byte for byte to its
namespace's ``dead-letters`` with why.

A message is dead-lettered only once that send is acknowledged, so the caller may then commit past it: a
crash before the ack redelivers the message, never loses it (bad input gets a clear error and loses nothing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from rollbus.codec import CodecError, encode_event
from rollbus.events import DeadLetterEvent
from rollbus.kafka.topics import dead_letters_for

T = TypeVar("T")
log = logging.getLogger("rollbus.dead_letters")


class Message(Protocol):
    """What a dead letter keeps of a consumed message (aiokafka's ``ConsumerRecord``, Faust's ``Message``)."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...


M = TypeVar("M", bound=Message)

# (dead-letter topic, encoded dead letter, the message's key); returns once the bus acknowledged it
Send = Callable[[str, bytes, bytes | None], Awaitable[object]]


def dead_letter(message: Message, error: Exception, service: str) -> DeadLetterEvent:
    """The dead letter for ``message``: its place, its original bytes, and why it failed."""
    return DeadLetterEvent(
        source_topic=message.topic, partition=message.partition, offset=message.offset, key=message.key,
        value=bytes(message.value or b""), error=f"{type(error).__name__}: {error}", service=service,
        at=int(time.time() * 1000),
    )  # fmt: skip


@dataclass(frozen=True)
class DeadLetters:
    """Where one service's consumer loop sends what it cannot process."""

    service: str
    send: Send

    async def decoded(self, message: M, decode: Callable[[M], T]) -> T | None:
        """``decode(message)``; None once a message that raised :class:`CodecError` (poison: undecodable,
        oversized, the wrong event type for its topic) is dead-lettered."""
        try:
            return decode(message)
        except CodecError as poison:
            await self.letter(message, poison)
            return None

    async def letter(self, message: Message, error: Exception) -> DeadLetterEvent:
        """Forward ``message`` unchanged to dead-letters with ``error``; returns once that is acknowledged."""
        letter = dead_letter(message, error, self.service)
        await self.send(dead_letters_for(message.topic), encode_event(letter), message.key)
        log.warning("%s: dead letter from %s[%d]@%d: %s", self.service, message.topic, message.partition,
                    message.offset, letter.error)  # fmt: skip
        return letter
