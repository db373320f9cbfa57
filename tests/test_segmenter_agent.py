"""What the segmenter's Faust agent does with one message, over stand-in topics that only record sends.

The real Faust worker and broker are exercised in tests/integration/test_segmenter.py; here the agent's
decisions (poison, a state-machine bug, segments acked before the rollout settles) are checked directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from rollbus.codec import decode, encode
from rollbus.segmentation import RolloutState, Segmenter
from services.segmenter.app import SegmenterAgent
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


def agent(segmenter: Segmenter | None = None) -> tuple[SegmenterAgent, Topic, Topic]:
    segments, letters = Topic(), Topic()
    segmenter = segmenter or Segmenter({}, {})
    return SegmenterAgent(segmenter, segments, letters, "ns.segmenter-ticks"), segments, letters


async def test_a_rollout_goes_out_and_settles_poison_is_dead_lettered() -> None:
    worker, segments, letters = agent()
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

    worker, segments, letters = agent(Broken({}, {}))
    for topic, record in simple_rollout("r2").events:
        await worker.handle(Message(f"ns.{topic}", encode(EVENT[topic], record), b"r2"))
    assert len(segments.sent) == 3  # the diff is not needed to cut
    assert len(letters.sent) == 1 and "RuntimeError: a bug" in letters.sent[0]["error"]
    assert worker.segmenter.counts["internal_error"] == 1
