"""The rollbus events: one frozen dataclass per schema (:mod:`~rollbus.events.records`), each declaring
its topic, Kafka key and identity beside its fields; the catalogue read off them
(:mod:`~rollbus.events.catalogue`, whose order is the wire format); the identity rule
(:mod:`~rollbus.events.identity`: what makes two events one fact); and the dict boundary the codec speaks
(:mod:`~rollbus.events.record`)."""

from rollbus.events.catalogue import (
    CLASSES,
    EVENT_TYPES,
    EVENTS,
    POLICY_KEY,
    TOPICS,
    EventSpec,
    event_class,
    spec,
)
from rollbus.events.identity import Identity, IdentityMatch, content_digest, judge
from rollbus.events.record import BadRecord, EventRecord, Record
from rollbus.events.records import (
    EVENT_CLASSES,
    ChainKind,
    DeadLetterEvent,
    DiffEvent,
    PolicyEvent,
    RewardEvent,
    RoutedExperts,
    SegmentEvent,
    SegmentKind,
    SessionEvent,
    SessionKind,
    TaskEvent,
    TestResult,
    TrainStepEvent,
    TurnEvent,
    TurnTimings,
)

__all__ = [
    "CLASSES", "EVENTS", "EVENT_CLASSES", "EVENT_TYPES", "POLICY_KEY", "TOPICS", "BadRecord", "ChainKind",
    "DeadLetterEvent", "DiffEvent", "EventRecord", "EventSpec", "Identity", "IdentityMatch", "PolicyEvent",
    "Record", "RewardEvent", "RoutedExperts", "SegmentEvent", "SegmentKind", "SessionEvent", "SessionKind",
    "TaskEvent", "TestResult", "TrainStepEvent", "TurnEvent", "TurnTimings", "content_digest", "event_class",
    "judge", "spec",
]  # fmt: skip
