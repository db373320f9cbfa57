"""Each event type's declared identity (rollbus.events.identity): what a retry is, what a conflict is, and
that the content digest, kept in the segmenter's changelog, stays the one states were written with."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from rollbus.events import EVENTS, content_digest, judge, spec

REWARD = spec("reward").identity


def reward(**changes: Any) -> dict[str, Any]:
    record = {"schema_version": 3, "rollout_id": "r1", "attempt_id": "a1", "reward": 1.0, "solved": True,
              "applied_cleanly": True, "details": '{"eval_s": 1.5, "loss_scope": "all_turns"}',
              "failure_kind": None, "at": 1_000, "group_id": "g", "group_size": 2, "flags": [], "tests": []}
    return {**record, **changes}  # fmt: skip


def test_a_reward_graded_again_identical_but_for_at_is_a_duplicate() -> None:
    assert judge(REWARD, reward(), reward(at=61_000)) == "duplicate"


def test_a_reward_graded_again_with_new_durations_is_a_duplicate_a_new_verdict_is_a_conflict() -> None:
    again = reward(at=61_000, details='{"eval_s": 2.25, "loss_scope": "all_turns"}')
    assert judge(REWARD, reward(), again) == "duplicate"
    assert judge(REWARD, reward(), reward(reward=0.0, solved=False)) == "conflict"
    assert judge(REWARD, reward(), reward(details='{"loss_scope": "last_turn"}')) == "conflict"
    assert judge(REWARD, reward(), reward(attempt_id="a2", at=5)) == "new"


def test_the_reward_digest_is_the_one_segmenter_states_kept() -> None:
    """The digest before identity was declared: every field but schema_version, at and details, plus
    details.loss_scope. A change here would make every redelivery after an upgrade a conflict."""
    record = reward()
    kept = {k: v for k, v in record.items() if k not in ("schema_version", "at", "details")}
    old = json.dumps({**kept, "loss_scope": "all_turns"}, sort_keys=True, default=str)
    assert content_digest(REWARD, record) == hashlib.blake2b(old.encode(), digest_size=12).hexdigest()
    assert content_digest(REWARD, reward(details="not json")) != content_digest(REWARD, record)


def test_every_event_type_names_its_facts_by_fields_it_has() -> None:
    from rollbus.codec import schema

    for event in EVENTS:
        names = {f["name"] for f in schema(event.event_type)["fields"]}
        rule = event.identity
        assert rule.key and set(rule.key) <= names, event.event_type
        assert set(rule.incidental) <= names and not set(rule.key) & set(rule.incidental), event.event_type
        assert {f for f, _ in rule.kept} <= set(rule.incidental), event.event_type


def test_a_readers_key_is_the_declared_one_a_missing_field_read_as_its_default() -> None:
    from rollbus.events import SegmentEvent, TurnEvent
    from rollbus.turn_log import turn_key
    from tests.event_samples import SAMPLES

    turn = {k: v for k, v in SAMPLES["turn"].items() if k != "attempt_id"}  # a writer before attempts
    assert TurnEvent.key_of(turn) == (turn["rollout_id"], "", turn["chain_id"], turn["turn_index"])
    assert turn_key(turn) == TurnEvent.key_of(turn, within=("rollout_id",))
    event = TurnEvent.from_dict(SAMPLES["turn"])
    assert event.identity_key() == TurnEvent.key_of(SAMPLES["turn"])
    assert SegmentEvent.key_of(SAMPLES["segment"]) == (SAMPLES["segment"]["segment_id"],)
