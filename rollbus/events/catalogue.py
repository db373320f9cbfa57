"""The catalogue of rollbus events: which event goes on which topic, keyed by which field.

Plain data, no I/O, so the codec, the bus and the docs agree on one list. The order of
:data:`EVENT_TYPES` is part of the wire format (an event's position is its type id in the
header), so new events are appended, never inserted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollbus.events.identity import Identity


@dataclass(frozen=True)
class EventSpec:
    """Where one kind of event lives on the bus."""

    event_type: str
    topic: str
    key_field: str | None  # record field used as the Kafka key; None: a constant or no key
    identity: Identity = field(default_factory=lambda: Identity(()))  # what makes two events one fact


EVENTS: tuple[EventSpec, ...] = (
    EventSpec("task", "tasks", "rollout_id", Identity(("rollout_id",))),
    # a turn's content digest is rollbus.turn_log.turn_digest (token arrays hashed as their bytes)
    EventSpec("turn", "turns", "rollout_id", Identity(
        ("rollout_id", "attempt_id", "chain_id", "turn_index"), ("schema_version", "timings"))),
    EventSpec("session", "sessions", "rollout_id",
              Identity(("rollout_id", "attempt_id", "chain_id", "kind"), ("schema_version", "at"))),
    EventSpec("diff", "diffs", "rollout_id", Identity(("rollout_id", "attempt_id"))),
    # a reward's content is its verdict: a grader that crashed after publishing grades the diff again, with a
    # new ``at`` and new durations in ``details``; details' one member that changes training stays content
    EventSpec("reward", "rewards", "rollout_id", Identity(
        ("rollout_id", "attempt_id"), ("schema_version", "at", "details"), (("details", "loss_scope"),))),
    EventSpec("segment", "segments", "rollout_id", Identity(("segment_id",))),
    EventSpec("policy", "policy", None, Identity(("version",))),
    EventSpec("dead_letter", "dead-letters", None, Identity(("source_topic", "partition", "offset"))),
    EventSpec("train_step", "train-steps", None, Identity(("step",))),
)  # fmt: skip

EVENT_TYPES: tuple[str, ...] = tuple(spec.event_type for spec in EVENTS)
TOPICS: dict[str, str] = {spec.event_type: spec.topic for spec in EVENTS}
POLICY_KEY = b"policy"  # the policy topic is compacted on this one key: the latest version wins


def spec(event_type: str) -> EventSpec:
    """The :class:`EventSpec` of ``event_type``; ``KeyError`` names the unknown type."""
    for candidate in EVENTS:
        if candidate.event_type == event_type:
            return candidate
    raise KeyError(f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}")
