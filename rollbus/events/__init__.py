"""The rollbus events: the catalogue (:mod:`~rollbus.events.catalogue`: topic and key of each event type) and
each type's identity rule (:mod:`~rollbus.events.identity`: what makes two events one fact)."""

from rollbus.events.catalogue import EVENT_TYPES, EVENTS, POLICY_KEY, TOPICS, EventSpec, spec
from rollbus.events.identity import Identity, Verdict, content_digest, judge

__all__ = [
    "EVENTS", "EVENT_TYPES", "POLICY_KEY", "TOPICS", "EventSpec", "Identity", "Verdict", "content_digest",
    "judge", "spec",
]  # fmt: skip
