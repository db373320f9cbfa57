"""Topic specs and naming: pure rules, no broker."""

from __future__ import annotations

import pytest

from rollbus.events import EVENTS
from rollbus.kafka.topics import (
    TOPICS,
    TopicsError,
    dead_letters_for,
    event_type_for,
    mismatched,
    partitions_of,
    spec_for,
    split_name,
    topic_name,
)


def test_every_event_has_a_topic_and_rollout_events_are_keyed_by_rollout() -> None:
    assert [(s.name, s.event_type) for s in TOPICS] == [(e.topic, e.event_type) for e in EVENTS]
    keyed = {s.name for s in TOPICS if s.rollout_keyed}
    assert keyed == {"tasks", "turns", "sessions", "diffs", "rewards", "segments"}


def test_raw_events_are_kept_forever_and_policy_is_compacted() -> None:
    for spec in TOPICS:
        assert spec.config()["retention.ms"] == "-1"
    assert spec_for("policy").config()["cleanup.policy"] == "compact"
    assert int(spec_for("dead-letters").max_message_bytes) > int(spec_for("turns").max_message_bytes)


def test_rollout_keyed_topics_share_the_configured_partition_count() -> None:
    assert {partitions_of(s, 12) for s in TOPICS if s.rollout_keyed} == {12}
    assert partitions_of(spec_for("policy"), 12) == 1
    assert partitions_of(spec_for("train-steps"), 12) == 1  # the steps in their order


@pytest.mark.parametrize("namespace", ["", "t-1", "demo.run7"])
def test_namespaced_names_round_trip(namespace: str) -> None:
    name = topic_name("dead-letters", namespace)
    assert split_name(name) == (namespace, "dead-letters")
    assert event_type_for(topic_name("turns", namespace)) == "turn"
    assert dead_letters_for(topic_name("rewards", namespace)) == name


def test_unknown_topic_is_named_in_the_error() -> None:
    with pytest.raises(TopicsError, match="'turn' is not a rollbus topic"):
        spec_for("turn")


def test_mismatch_lists_the_offending_counts() -> None:
    same = {"tasks": 6, "turns": 6, "sessions": 6, "diffs": 6, "rewards": 6, "segments": 6, "policy": 1,
            "train-steps": 1}
    assert mismatched(same) is None
    problem = mismatched({**same, "rewards": 3})
    assert problem is not None and "rewards=3" in problem and "turns=6" in problem
