"""The outbox as a broker having a bad day would test it: slow acks, permanent refusals, outages,
restarts. Each publisher below fails the way aiokafka does, at the narrowest boundary (one send)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError, MessageSizeTooLargeError

from rollbus.codec import CodecError, decode
from rollbus.services.adapter.publisher import SPILL_FILE, BacklogFull, Outbox, RecordTooLarge, retriable
from tests.test_adapter_support import BusPublisher
from tests.waiting import until


def session(n: int, rollout: str = "r") -> dict:
    return {
        "rollout_id": rollout,
        "chain_id": "main",
        "kind": "opened",
        "chain_kind": "main",
        "reason": None,
        "turn_count": n,
        "parent_chain_id": None,
        "at": 0,
    }


def counts(publisher: BusPublisher, topic: str = "sessions") -> list[int]:
    return [r["turn_count"] for t, _, r in publisher.events if t == topic]


class SlowAcks(BusPublisher):
    """Acknowledges after ``delay`` s; as with aiokafka, cancelling the wait does not stop the send."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.sends = 0

    async def publish_bytes(self, topic, value, *, key) -> None:
        self.sends += 1

        async def deliver() -> None:
            await asyncio.sleep(self.delay)
            await BusPublisher.publish_bytes(self, topic, value, key=key)

        await asyncio.shield(asyncio.ensure_future(deliver()))


async def test_a_slow_ack_is_waited_for_not_sent_twice() -> None:
    publisher = SlowAcks(delay=5.5)  # over the 5 s the old outbox gave a send before resending it
    outbox = Outbox(publisher, retry_interval=0.01)
    await outbox.publish("sessions", session(0), key="r")
    assert publisher.sends == 1 and counts(publisher) == [0]  # a resend would have been sent before the ack


class Refuses(BusPublisher):
    """Refuses records of one turn_count for good (``MessageSizeTooLargeError``); dead letters too if
    ``refuse_dead_letters``."""

    def __init__(self, poison: int, refuse_dead_letters: bool = False) -> None:
        super().__init__()
        self.poison = poison
        self.refuse_dead_letters = refuse_dead_letters

    async def publish_bytes(self, topic, value, *, key) -> None:
        record = decode(value).record
        if topic == "dead-letters" and self.refuse_dead_letters:
            raise MessageSizeTooLargeError("dead letter refused (test)")
        if topic == "sessions" and record["turn_count"] == self.poison:
            raise MessageSizeTooLargeError("too large (test)")
        await super().publish_bytes(topic, value, key=key)


async def test_a_record_refused_for_good_is_dead_lettered_and_the_drain_goes_on() -> None:
    publisher = Refuses(poison=1)
    outbox = Outbox(publisher, retry_interval=0.01)
    outbox.enqueue([("sessions", session(n), "r") for n in range(3)])
    await outbox.flush(timeout=10)
    assert counts(publisher) == [0, 2]
    letters = [r for t, _, r in publisher.events if t == "dead-letters"]
    assert len(letters) == 1 and letters[0]["source_topic"] == "sessions"
    assert "MessageSizeTooLargeError" in letters[0]["error"] and letters[0]["offset"] == -1
    assert decode(letters[0]["value"]).record["turn_count"] == 1  # the bytes, unchanged
    assert outbox.dead_lettered == 1 and not outbox.backlog and outbox.backlog_bytes == 0


async def test_when_even_dead_letters_refuse_the_record_is_kept_on_disk(tmp_path: Path) -> None:
    publisher = Refuses(poison=0, refuse_dead_letters=True)
    outbox = Outbox(publisher, retry_interval=0.01, state_dir=tmp_path)
    outbox.enqueue([("sessions", session(0), "r"), ("sessions", session(1), "r")])
    await outbox.flush(timeout=10)
    assert counts(publisher) == [1]
    kept = [json.loads(line) for line in (tmp_path / "adapter-rejected.jsonl").read_text().splitlines()]
    assert len(kept) == 1 and "MessageSizeTooLargeError" in kept[0]["error"]
    assert not (tmp_path / SPILL_FILE).exists()  # rejected records are not replayed at the next start


async def test_a_record_that_cannot_be_encoded_fails_at_enqueue_and_queues_nothing() -> None:
    publisher = BusPublisher()
    outbox = Outbox(publisher, retry_interval=0.01)
    with pytest.raises(CodecError):
        outbox.enqueue([("sessions", session(0), "r"), ("sessions", {"rollout_id": "r"}, "r")])
    assert not outbox.backlog
    with pytest.raises(RecordTooLarge):
        Outbox(publisher, max_event_bytes=10).enqueue([("sessions", session(0), "r")])
    await outbox.publish("sessions", session(1), key="r")
    assert counts(publisher) == [1]


async def test_an_outage_keeps_order_and_the_backlog_is_bounded_in_records_and_bytes() -> None:
    publisher = BusPublisher()
    publisher.down = True
    outbox = Outbox(publisher, capacity=6, retry_interval=0.01)
    for n in range(2):
        outbox.reserve()
        outbox.enqueue([("sessions", session(n), "r")])
        outbox.release()
    outbox.reserve()  # 2 queued + 4 for this turn = 6: full
    with pytest.raises(BacklogFull, match="records"):
        outbox.reserve()
    outbox.release()
    by_bytes = Outbox(publisher, capacity_bytes=100, retry_interval=0.01)
    by_bytes.enqueue([("sessions", session(n), "r") for n in range(5)])
    assert by_bytes.backlog_bytes >= 100
    with pytest.raises(BacklogFull, match="bytes"):
        by_bytes.reserve()
    publisher.down = False
    outbox.enqueue([("sessions", session(2), "r")])
    await outbox.flush(timeout=10)
    await by_bytes.flush(timeout=10)
    assert counts(publisher)[:3] == [0, 1, 2]
    outbox.reserve()


@pytest.mark.parametrize(
    "error, expected",
    [
        (KafkaConnectionError(), True),
        (KafkaTimeoutError(), True),
        (MessageSizeTooLargeError(), False),
        (OSError("reset"), True),
        (ValueError("bad"), False),
    ],
)
def test_what_is_retried(error, expected) -> None:
    assert retriable(error) is expected


async def test_spilled_records_are_published_at_the_next_start_exactly_once(tmp_path: Path) -> None:
    down = BusPublisher()
    down.down = True
    first = Outbox(down, retry_interval=0.01, state_dir=tmp_path)
    first.enqueue([("sessions", session(n), "r") for n in range(3)])
    await until(lambda: down.refused >= 2, "the drain tried the down bus again")
    assert first.spill() == 3 and (tmp_path / SPILL_FILE).exists()

    up = BusPublisher()
    second = Outbox(up, retry_interval=0.01, state_dir=tmp_path)
    assert second.recover() == 3
    second.enqueue([("sessions", session(9), "r")])  # a new turn goes after the replayed ones
    await second.flush(timeout=10)
    assert counts(up) == [0, 1, 2, 9]
    await until(lambda: not any(tmp_path.iterdir()), "the replayed file removed once delivered")
    third = Outbox(up, retry_interval=0.01, state_dir=tmp_path)
    assert third.recover() == 0


async def test_a_replay_cut_short_is_spilled_again_and_not_lost(tmp_path: Path) -> None:
    down = BusPublisher()
    down.down = True
    first = Outbox(down, retry_interval=0.01, state_dir=tmp_path)
    first.enqueue([("sessions", session(0), "r")])
    first.spill()
    second = Outbox(down, retry_interval=0.01, state_dir=tmp_path)
    assert second.recover() == 1
    assert second.spill() == 1  # still down at the second shutdown
    assert [p.name for p in tmp_path.iterdir()] == [SPILL_FILE]
    up = BusPublisher()
    third = Outbox(up, retry_interval=0.01, state_dir=tmp_path)
    assert third.recover() == 1
    await third.flush(timeout=10)
    assert counts(up) == [0]


async def test_old_spill_files_with_records_are_still_replayed(tmp_path: Path) -> None:
    line = {"topic": "sessions", "key": "r", "record": session(4)}
    (tmp_path / SPILL_FILE).write_text(json.dumps(line) + "\n")
    up = BusPublisher()
    outbox = Outbox(up, retry_interval=0.01, state_dir=tmp_path)
    assert outbox.recover() == 1
    await outbox.flush(timeout=10)
    assert counts(up) == [4]


async def test_outbox_publishes_to_its_topic_namespace() -> None:
    publisher = BusPublisher()
    await Outbox(publisher, namespace="t-42").publish("turns", _turn(), key="r")
    await Outbox(publisher).publish("sessions", session(0), key="r")
    assert [t for t, _, _ in publisher.events] == ["t-42.turns", "sessions"]


def _turn() -> dict:
    return {
        "rollout_id": "r",
        "chain_id": "main",
        "chain_kind": "main",
        "turn_index": 0,
        "prompt_ref_turn": None,
        "prompt_ids": [1],
        "prompt_tokens": 1,
        "output_ids": [2],
        "output_logprobs": [-0.5],
        "finish_reason": "stop",
        "policy_version": 0,
        "request_id": "rb-1",
        "timings": {"started_at": 0, "finished_at": 1, "generation_ms": 1},
    }
