"""What the segmenter's handler does with one message, over stand-in topics that only record sends.

The real Faust worker and broker are exercised in tests/integration/test_segmenter.py; here the handler's
decisions (poison, a state-machine bug, segments acked before the rollout settles) are checked directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from rollbus.codec import decode, encode
from rollbus.services.segmenter.app import SegmenterHandler
from rollbus.services.segmenter.segmentation import RolloutState, Segmenter
from tests.synthetic_rollouts import simple_rollout

EVENT = {"turns": "turn", "sessions": "session", "diffs": "diff", "rewards": "reward"}


@dataclass
class Message:
    topic: str
    value: bytes
    key: bytes
    partition: int = 0
    offset: int = 0
    timestamp: float = 1.0


class Topic:
    """Records what was sent; ``send`` returns an awaitable ack, as a Faust topic's ``send`` does."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def send(self, *, key: bytes, value: bytes, force: bool = False) -> Any:
        self.sent.append(decode(value).record)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def handler(segmenter: Segmenter | None = None) -> tuple[SegmenterHandler, Topic, Topic]:
    segments, letters = Topic(), Topic()
    segmenter = segmenter or Segmenter({}, {})
    return SegmenterHandler(segmenter, segments, letters, "ns.segmenter-ticks"), segments, letters


async def test_a_rollout_goes_out_and_settles_poison_is_dead_lettered() -> None:
    worker, segments, letters = handler()
    await worker.handle(Message("ns.turns", b"junk", b"r1"))
    for topic, record in simple_rollout("r1").events:
        await worker.handle(Message(f"ns.{topic}", encode(EVENT[topic], record), b"r1"))
    assert [s["kind"] for s in segments.sent] == ["subagent", "wipe", "final"]
    assert RolloutState.from_bytes(worker.segmenter.states["r1"]).status == "emitted"
    assert len(letters.sent) == 1 and letters.sent[0]["value"] == b"junk"


async def test_a_state_machine_failure_dead_letters_the_message_and_processing_goes_on() -> None:
    class Broken(Segmenter):
        def handle(self, fact, raw, partition=-1):  # noqa: ANN001, ANN202
            if fact.kind == "diff":
                raise RuntimeError("a bug")
            return super().handle(fact, raw, partition)

    worker, segments, letters = handler(Broken({}, {}))
    for topic, record in simple_rollout("r2").events:
        await worker.handle(Message(f"ns.{topic}", encode(EVENT[topic], record), b"r2"))
    assert len(segments.sent) == 3  # the diff is not needed to cut
    assert len(letters.sent) == 1 and "RuntimeError: a bug" in letters.sent[0]["error"]
    assert worker.segmenter.counts["internal_error"] == 1


async def test_a_bus_failure_crashes_the_worker_and_leaves_the_message_unhandled() -> None:
    """A segment's send that fails is not the message's fault: no dead letter, the worker stops (its
    agent leaves the message unacked, so uncommitted), and the rollout is not marked emitted."""
    crashed: list[BaseException] = []

    class Failing(Topic):
        async def send(self, *, key: bytes, value: bytes, force: bool = False) -> Any:
            raise ConnectionError("the broker went away")

    async def crash(error: BaseException) -> None:
        crashed.append(error)

    letters = Topic()
    worker = SegmenterHandler(Segmenter({}, {}), Failing(), letters, "ns.segmenter-ticks", crash)
    events = simple_rollout("r3").events
    for topic, record in events[:-1]:
        await worker.handle_or_crash(Message(f"ns.{topic}", encode(EVENT[topic], record), b"r3"))
    topic, record = events[-1]
    with pytest.raises(ConnectionError):
        await worker.handle_or_crash(Message(f"ns.{topic}", encode(EVENT[topic], record), b"r3"))
    assert [type(e) for e in crashed] == [ConnectionError] and letters.sent == []
    assert RolloutState.from_bytes(worker.segmenter.states["r3"]).status == "open"
