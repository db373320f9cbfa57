"""Decode or dead-letter (rollbus.kafka.dead_letters), the one helper every consumer loop uses: poison goes
to its namespace's dead-letters byte for byte with why, and only once the bus took it does the loop go on."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from rollbus import codec
from rollbus.events import DeadLetterEvent, RewardEvent
from rollbus.kafka.bus import Event, decode_message
from rollbus.kafka.dead_letters import DeadLetters
from tests.event_samples import SAMPLES


@dataclass
class Message:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int = 0


def run(letters: DeadLetters, message: Message) -> object:
    return asyncio.run(letters.decoded(message, lambda m: decode_message(m, 1 << 20)))


def collecting() -> tuple[DeadLetters, list[tuple[str, bytes, bytes | None]]]:
    sent: list[tuple[str, bytes, bytes | None]] = []

    async def send(topic: str, value: bytes, key: bytes | None) -> None:
        sent.append((topic, value, key))

    return DeadLetters("grader", send), sent


def test_an_event_decodes_and_nothing_is_dead_lettered() -> None:
    letters, sent = collecting()
    event = run(letters, Message("t1.rewards", 0, 7, b"r1", codec.encode("reward", SAMPLES["reward"])))
    assert isinstance(event, Event) and event.event == RewardEvent.from_dict(SAMPLES["reward"]) and sent == []


@pytest.mark.parametrize(
    ("value", "error"),
    [(b"RB\x63junk", "unknown event type id 99"), (None, "shorter than the 5-byte header"),
     (codec.encode("diff", SAMPLES["diff"]), "diff event on 't1.rewards', which carries reward events")],
)  # fmt: skip
def test_poison_goes_to_its_namespaces_dead_letters_whole_with_why(value: bytes | None, error: str) -> None:
    letters, sent = collecting()
    assert run(letters, Message("t1.rewards", 2, 41, b"r1", value)) is None
    ((topic, data, key),) = sent
    letter = codec.decode_as(DeadLetterEvent, data)
    assert (topic, key, letter.source_topic, letter.partition, letter.offset) == (
        "t1.dead-letters", b"r1", "t1.rewards", 2, 41)  # fmt: skip
    assert letter.value == (value or b"") and error in letter.error and letter.service == "grader"


def test_a_dead_letter_the_bus_did_not_take_stops_the_loop() -> None:
    """The send fails: the error reaches the loop, which must not commit past the message."""

    async def refuse(topic: str, value: bytes, key: bytes | None) -> None:
        raise ConnectionError("broker away")

    with pytest.raises(ConnectionError):
        run(DeadLetters("grader", refuse), Message("t1.rewards", 0, 1, None, b"junk"))
