"""The segmenter's driver over the pure state machine: decoding facts from the topics, the rollout and body
tables, and the outputs each handled event produces (:class:`Handled`), settled once acknowledged."""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollbus.codec import CodecError, Scanned, decode_scans, encode, scan
from rollbus.events import SegmentEvent
from rollbus.kafka.topics import MAX_EVENT_BYTES, spec_for, split_name
from rollbus.services.segmenter.segmentation.completion import complete, cut, expire
from rollbus.services.segmenter.segmentation.merge import apply, kill, seal
from rollbus.services.segmenter.segmentation.state import FACT_KINDS, Admission, Fact, RolloutState, Status
from rollbus.trajectory import ChainBroken, LossScope
from rollbus.turn_log import (
    TurnKey,
    UnresolvedTurn,
)


@dataclass
class Options:
    """What cutting and expiring need; services fill it from their settings."""

    loss_scope: LossScope = "all_turns"
    history_mode: str = "canonical"
    timeout_ms: int = 3_600_000
    forget_after_ms: int = 3_600_000


@dataclass
class Handled:
    """What handling one event produced. ``segments`` (records, and ``messages``, the same encoded) must be
    acknowledged before :meth:`Segmenter.settle`."""

    rollout_id: str
    admission: Admission
    segments: list[SegmentEvent] = field(default_factory=list)
    messages: list[bytes] = field(default_factory=list)
    dead_letter: str | None = None
    finished: Status | None = None  # the state to settle into once outputs are out


def body_key(rollout_id: str, key: TurnKey) -> str:
    """The turn-bodies key: JSON, so no id, whatever characters it holds, can collide with another's.
    Exactly ``json.dumps([rollout_id, *key])`` (keys already in changelogs stay valid), built from the
    encoder's string escaping: three of these a turn made the general encoder a visible cost."""
    attempt, chain, index = key
    return f"[{_json_string(rollout_id)}, {_json_string(attempt)}, {_json_string(chain)}, {int(index)}]"


_json_string = json.encoder.encode_basestring_ascii  # what json.dumps writes a str as (ensure_ascii)


class Segmenter:
    """The state machine over storage: ``states`` (rollout id -> state bytes) and ``bodies`` (turn -> bytes).

    Every write assigns a whole value (Faust tables only log assignments). ``handle`` never marks a rollout
    emitted: the caller publishes the outcome's segments, waits for the acks, then calls ``settle``, so a
    crash in between re-cuts the same segments from intact state instead of losing them.

    A clock index (partition -> rollout id -> (last event time, open)) mirrors every state this object
    writes, so a tick reads only the states that are due instead of parsing the whole table once per
    partition. It is rebuilt from ``states`` on the first tick and after :meth:`reindex`, which the worker
    calls when a rebalance may have changed the table behind its back (changelog recovery).

    The scan of every body kept since then is kept with it (its record and where its arrays lie, ~2 KB a
    turn next to the body's own bytes, which it shares): the cut then decodes the rollout's bodies without
    reading any of them again. A body without one (stored before a restart or a rebalance) is scanned anew.
    """

    def __init__(
        self,
        states: MutableMapping[str, bytes],
        bodies: MutableMapping[str, bytes],
        options: Options | None = None,
    ) -> None:
        self.states, self.bodies = states, bodies
        self.options = options or Options()
        self.counts: dict[str, int] = {}
        self._clock: dict[int, dict[str, tuple[int, bool]]] | None = None
        self._open: dict[str, RolloutState] = {}  # open states as last stored, so no event parses one
        self._scans: dict[str, Scanned] = {}  # body key -> the scan of the bytes stored there

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def load(self, rollout_id: str, partition: int = -1) -> RolloutState:
        """The rollout's state, the caller's to change and :meth:`_store`: taken out of the cache of open
        states, so a handler that fails half-way leaves only the stored bytes, which are still right."""
        cached = self._open.pop(rollout_id, None)
        if cached is not None:
            return cached
        raw = self.states.get(rollout_id)
        return RolloutState.from_bytes(raw) if raw is not None else RolloutState(rollout_id, partition)

    def reindex(self) -> None:
        """Forget the clock index and the cached states: ``states`` was changed behind this object's back
        (changelog recovery after a rebalance); the next tick rebuilds the index from it."""
        self._clock = None
        self._open.clear()
        self._scans.clear()

    def _store(self, state: RolloutState) -> None:
        self.states[state.rollout_id] = state.to_bytes()
        if state.open:
            self._open[state.rollout_id] = state
        else:
            self._open.pop(state.rollout_id, None)
        if self._clock is not None:
            self._clock.setdefault(state.partition, {})[state.rollout_id] = (state.last_at, state.open)

    def _forget(self, state: RolloutState) -> None:
        del self.states[state.rollout_id]
        self._open.pop(state.rollout_id, None)
        if self._clock is not None:
            self._clock.get(state.partition, {}).pop(state.rollout_id, None)

    def handle(self, fact: Fact, raw: bytes, partition: int = -1) -> Handled:
        """Merge one event (``raw`` is its message bytes, kept as the turn body) and cut if complete."""
        rollout_id = fact.record["rollout_id"]
        state = self.load(rollout_id, partition)
        was_open = state.open
        step = apply(state, fact)
        self.count(step.admission)
        if step.store is not None:
            key = body_key(rollout_id, step.store)
            self.bodies[key] = raw
            if fact.scanned is not None and fact.scanned.data == raw:
                self._scans[key] = fact.scanned
        outcome = Handled(rollout_id, step.admission, dead_letter=step.dead_letter)
        if complete(state):
            self._cut(state, outcome)
        if was_open and state.status == "dead":
            outcome.finished = "dead"
            self.count("dead")
            self._drop_bodies(state)
            seal(state)
        self._store(state)
        return outcome

    def _cut(self, state: RolloutState, outcome: Handled) -> None:
        def bodies(keys: list[TurnKey]) -> Sequence[Mapping[str, Any]]:
            """The turns' records: ids as the bytes they arrived as, logprobs as numpy arrays."""
            named = [body_key(state.rollout_id, key) for key in keys]
            scans = [self._scans.get(name) or scan(self.bodies[name]) for name in named]
            return [decoded.record for decoded in decode_scans(scans, varints=True)]

        try:
            outcome.segments = cut(
                state, bodies, loss_scope=self.options.loss_scope, history_mode=self.options.history_mode
            )
            outcome.messages = [encode("segment", segment) for segment in outcome.segments]
        except (UnresolvedTurn, ChainBroken, ValueError, KeyError, OverflowError) as error:
            # a segment the codec refuses (a token id out of range in a turn) is as bad as a broken chain
            outcome.segments, outcome.messages = [], []
            kill(state, f"cannot cut segments: {type(error).__name__}: {error}")
            outcome.dead_letter = f"rollout {state.rollout_id} dead-lettered: {state.reason}"
            outcome.finished = "dead"
            return
        outcome.finished = "emitted"

    def settle(self, outcome: Handled) -> None:
        """After the outcome's segments are acknowledged: the rollout sealed, its bodies deleted."""
        if outcome.finished != "emitted":
            return
        state = self.load(outcome.rollout_id)
        if not state.open:
            return
        state.status, state.reason = "emitted", f"{len(outcome.segments)} segment(s)"
        self._drop_bodies(state)
        seal(state)
        self._store(state)
        self.count("emitted")
        self.count("segments", len(outcome.segments))

    def tick(self, now: int, partition: int | None = None) -> list[RolloutState]:
        """Abort rollouts idle past the timeout (returned, for counting) and forget old sealed states."""
        aborted = []
        for state in self._due(now, partition):
            due = expire(state, now, self.options.timeout_ms, self.options.forget_after_ms)
            if due == "abort":
                self._drop_bodies(state)
                seal(state)
                self._store(state)
                self.count("aborted")
                aborted.append(state)
            elif due == "forget":
                self._forget(state)
        return aborted

    def _due(self, now: int, partition: int | None) -> list[RolloutState]:
        """States of ``partition`` (all when None; those stored without one on every tick) that the clock
        index says are due to abort or be forgotten, read from ``states``."""
        if self._clock is None:
            self._clock = {}
            for raw in self.states.values():
                state = RolloutState.from_bytes(raw)
                self._clock.setdefault(state.partition, {})[state.rollout_id] = (state.last_at, state.open)
        timeout, forget = self.options.timeout_ms, self.options.forget_after_ms
        wanted = self._clock.keys() if partition is None else {partition, -1}
        due = [
            rollout_id
            for p in list(wanted)
            for rollout_id, (last_at, is_open) in self._clock.get(p, {}).items()
            if now - last_at >= (timeout if is_open else forget)
        ]
        return [RolloutState.from_bytes(raw) for raw in map(self.states.get, due) if raw is not None]

    def _drop_bodies(self, state: RolloutState) -> None:
        for key in state.body_keys():
            name = body_key(state.rollout_id, key)
            self.bodies.pop(name, None)
            self._scans.pop(name, None)


class WrongKey(CodecError):
    """An event whose Kafka key is not its rollout id: it sits on another rollout's partition."""


def decode_fact(topic: str, value: bytes | None, key: bytes | None, timestamp_ms: int) -> Fact:
    """The fact in one message of ``turns``/``sessions``/``diffs``/``rewards``; CodecError if poison."""
    data = value or b""
    if len(data) > MAX_EVENT_BYTES:
        raise CodecError(f"message of {len(data)} bytes is over the limit of {MAX_EVENT_BYTES}")
    scanned = scan(data)  # refused exactly as a decode would be; a turn's tokens stay undecoded
    expected = spec_for(topic).event_type
    if scanned.event_type != expected:
        raise CodecError(f"{scanned.event_type} event on {topic!r}, which carries {expected} events")
    rollout_id = scanned.record["rollout_id"]
    if key != rollout_id.encode():
        raise WrongKey(f"message key {key!r} is not its rollout id {rollout_id!r}")
    if scanned.event_type != "turn":
        return Fact(FACT_KINDS[split_name(topic)[1]], scanned.decoded().record, timestamp_ms)
    return Fact("turn", scanned.record, timestamp_ms, scanned)
