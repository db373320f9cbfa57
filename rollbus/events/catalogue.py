"""The catalogue of rollbus events: which event goes on which topic, keyed by which field, identified how;
read off the event classes (:mod:`rollbus.events.records`), which declare it beside their fields.

Plain data, no I/O, so the codec, the bus and the docs agree on one list. The order of
:data:`EVENT_TYPES` is part of the wire format (an event's position is its type id in the
header), so new events are appended, never inserted.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollbus.events.identity import Identity
from rollbus.events.record import EventRecord
from rollbus.events.records import EVENT_CLASSES


@dataclass(frozen=True)
class EventSpec:
    """Where one kind of event lives on the bus."""

    event_type: str
    topic: str
    key_field: str | None  # record field used as the Kafka key; None: a constant or no key
    identity: Identity  # what makes two events one fact


EVENTS: tuple[EventSpec, ...] = tuple(
    EventSpec(c.event_type, c.topic, c.key_field, c.identity) for c in EVENT_CLASSES
)
CLASSES: dict[str, type[EventRecord]] = {c.event_type: c for c in EVENT_CLASSES}
EVENT_TYPES: tuple[str, ...] = tuple(spec.event_type for spec in EVENTS)
TOPICS: dict[str, str] = {spec.event_type: spec.topic for spec in EVENTS}
POLICY_KEY = b"policy"  # the policy topic is compacted on this one key: the latest version wins


def spec(event_type: str) -> EventSpec:
    """The :class:`EventSpec` of ``event_type``; ``KeyError`` names the unknown type."""
    for candidate in EVENTS:
        if candidate.event_type == event_type:
            return candidate
    raise KeyError(f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}")


def event_class(event_type: str) -> type[EventRecord]:
    """The class of ``event_type``'s events; ``KeyError`` names the unknown type."""
    try:
        return CLASSES[event_type]
    except KeyError:
        raise KeyError(f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}") from None
