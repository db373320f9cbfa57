"""The codec speaks the event classes (rollbus.events): a decoded message's ``event``, ``encode_event``,
``decode_as``; the bytes are those of the record's dict, so the wire format does not move."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbus import codec
from rollbus.codec import CodecError
from rollbus.events import EVENT_TYPES, DiffEvent, RewardEvent, TestResult, event_class
from tests.avro_strategies import records
from tests.event_samples import SAMPLES


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(data=st.data())
def test_an_event_encodes_to_the_bytes_of_its_record(event_type, data):
    record = data.draw(records(codec.schema(event_type)))
    wire = codec.encode(event_type, record)
    event = codec.decode(wire).event
    assert type(event) is event_class(event_type)
    assert codec.encode_event(event) == wire == codec.encode(event_type, event)
    assert codec.decode(codec.encode_event(event)).record == codec.decode(wire).record


def test_a_built_event_gets_its_schema_defaults_on_the_wire() -> None:
    reward = RewardEvent(rollout_id="r1", reward=1.0, solved=True, applied_cleanly=True, details="{}", at=5,
                         tests=[TestResult(name="t::a", status="PASSED")])  # fmt: skip
    decoded = codec.decode(codec.encode_event(reward))
    assert decoded.event == reward and decoded.record["group_size"] == 1 and decoded.record["flags"] == []
    assert codec.decode_as(RewardEvent, codec.encode_event(reward)) == reward


def test_an_event_of_another_type_is_refused_both_ways() -> None:
    diff = DiffEvent.from_dict(SAMPLES["diff"])
    with pytest.raises(CodecError, match="a diff event cannot be encoded as a reward event"):
        codec.encode("reward", diff)
    with pytest.raises(CodecError, match="diff event where a reward event was expected"):
        codec.decode_as(RewardEvent, codec.encode_event(diff))


def test_the_publisher_keys_an_event_as_it_keys_its_dict() -> None:
    from rollbus.kafka.bus import key_for
    from rollbus.kafka.topics import topic_name

    for event_type, record in SAMPLES.items():
        event = event_class(event_type).from_dict(record)
        topic = topic_name(event.topic, "t1")
        assert key_for(topic, event) == key_for(topic, record)
    assert key_for(topic_name("rewards", "t1"), RewardEvent.from_dict(SAMPLES["reward"])) is not None
