"""The catalogue of rollbus events: which event goes on which topic, keyed by which field.

Plain data, no I/O, so the codec, the bus and the docs agree on one list. The order of
:data:`EVENT_TYPES` is part of the wire format (an event's position is its type id in the
header), so new events are appended, never inserted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventSpec:
    """Where one kind of event lives on the bus."""

    event_type: str
    topic: str
    key_field: str | None  # record field used as the Kafka key; None: a constant or no key


EVENTS: tuple[EventSpec, ...] = (
    EventSpec("task", "tasks", "rollout_id"),
    EventSpec("turn", "turns", "rollout_id"),
    EventSpec("session", "sessions", "rollout_id"),
    EventSpec("diff", "diffs", "rollout_id"),
    EventSpec("reward", "rewards", "rollout_id"),
    EventSpec("segment", "segments", "rollout_id"),
    EventSpec("policy", "policy", None),
    EventSpec("dead_letter", "dead-letters", None),
    EventSpec("train_step", "train-steps", None),
)

EVENT_TYPES: tuple[str, ...] = tuple(spec.event_type for spec in EVENTS)
TOPICS: dict[str, str] = {spec.event_type: spec.topic for spec in EVENTS}
POLICY_KEY = b"policy"  # the policy topic is compacted on this one key: the latest version wins


def spec(event_type: str) -> EventSpec:
    """The :class:`EventSpec` of ``event_type``; ``KeyError`` names the unknown type."""
    for candidate in EVENTS:
        if candidate.event_type == event_type:
            return candidate
    raise KeyError(f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}")
