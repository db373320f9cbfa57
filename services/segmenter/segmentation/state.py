"""A rollout's state as the segmenter keeps it: the facts seen, per chain, and what each fact may do next."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from rollbus.codec import Scanned
from rollbus.turn_log import (
    TurnKey,
)

FactKind = Literal["turn", "session", "diff", "reward"]


Status = Literal["open", "emitted", "aborted", "dead"]
# how a rollout's state took one fact: kept, dropped as a retry, too late (after the cut), or refused
Admission = Literal["new", "duplicate", "late", "rejected"]


TRAINABLE = ("main", "subagent")


FACT_KINDS: dict[str, FactKind] = {
    "turns": "turn",
    "sessions": "session",
    "diffs": "diff",
    "rewards": "reward",
}


@dataclass(frozen=True)
class Fact:
    """One decoded event of a rollout and when the broker stored it (milliseconds). A turn read off the
    wire is only ``scanned``: its ``record`` lacks the token arrays, which nothing here needs but the
    digest (hashed from their bytes) and, when a rollout is cut, the body kept as bytes."""

    kind: FactKind
    record: Mapping[str, Any]
    at: int
    scanned: Scanned | None = None


@dataclass
class ChainFacts:
    """What the rollout's events say about one chain of one attempt."""

    kind: str  # main | subagent | side | unattributed
    turns: dict[str, str] = field(default_factory=dict)  # str(turn index) -> turn digest
    end: str | None = None  # frozen | closed: no turn will extend it
    turn_count: int | None = None  # turns it had when it ended
    end_seq: int | None = None  # position of its end among the rollout's session events
    closed_seq: int | None = None  # position of a ``closed`` event for it
    ambiguous: bool = False  # ended ``ambiguous``: its origin is unproven (two claimed one Agent call)


_STATE_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # a state has no cycles


@dataclass
class RolloutState:
    """Everything the segmenter keeps for one rollout, small and JSON-able (the table's value)."""

    rollout_id: str
    partition: int = -1
    status: Status = "open"
    reason: str | None = None
    last_at: int = 0
    seq: int = 0
    attempts: dict[str, dict[str, ChainFacts]] = field(default_factory=dict)
    closed: list[str] = field(default_factory=list)  # attempts with a ``closed`` session event
    sessions: dict[str, str] = field(default_factory=dict)  # session identity -> digest
    diffs: dict[str, list[Any]] = field(default_factory=dict)  # attempt -> [digest, group_id, group_size]
    reward: dict[str, Any] | None = None
    duplicates: int = 0
    seen: str = ""  # a sealed state's facts: base64 of 8-byte fingerprints (see merge.seal)

    def to_bytes(self) -> bytes:
        """The table value; written after every event, so built from ``vars`` (``asdict`` deep-copies
        every digest and cost more than the rest of a turn's handling) and encoded by orjson. Either
        encoder's bytes read back the same (:meth:`from_bytes`)."""
        raw = dict(vars(self))
        raw["attempts"] = {a: {c: vars(f) for c, f in cs.items()} for a, cs in self.attempts.items()}
        if self.reward is None or math.isfinite(self.reward.get("reward", 0.0)):  # orjson: NaN as null
            try:
                return orjson.dumps(raw)  # ~10x the standard encoder on a long rollout's state
            except orjson.JSONEncodeError:  # what it refuses (an int past 64 bits), the standard one writes
                pass
        return _STATE_JSON.encode(raw).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RolloutState:
        raw = json.loads(data)
        attempts = raw.pop("attempts")
        return cls(
            attempts={a: {c: ChainFacts(**f) for c, f in cs.items()} for a, cs in attempts.items()}, **raw
        )

    @property
    def open(self) -> bool:
        return self.status == "open"

    def body_keys(self) -> list[TurnKey]:
        """Identities of every trainable turn body kept for this rollout (all attempts)."""
        return [
            (attempt, chain_id, int(index))
            for attempt, chains in self.attempts.items()
            for chain_id, chain in chains.items()
            if chain.kind in TRAINABLE
            for index in chain.turns
        ]


@dataclass
class Step:
    """How the fact was admitted (:data:`Admission`), a turn body to keep, why to dead-letter it."""

    admission: Admission
    store: TurnKey | None = None
    dead_letter: str | None = None


class Conflict(ValueError):
    """Events of one rollout contradict each other; the rollout cannot be trusted to train."""
