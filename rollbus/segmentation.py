"""A rollout's events -> its reward/K segments: the segmenter's state machine (pure, no I/O).

The segmenter, ``rollbus rebuild segments`` and the tests all drive this module, so a live run and a
replay of the raw topics cut the same segments. One :class:`RolloutState` per rollout id collects
*facts* from the four co-partitioned topics (turns, sessions, diffs, rewards) in whatever order they
interleave:

* a fact has an identity (a turn's is (attempt, chain, turn index)); a second fact with the same identity
  and digest is a writer's retry, dropped and counted; one with another digest is a conflict, and the
  rollout is dead-lettered with the reason;
* turn bodies are kept apart, as the bytes that were published (the prompt-reference encoding): the state
  holds only digests and counts, so it grows with turns, not tokens, and no prompt is ever resolved;
* the rollout is complete when the rewarded attempt was closed (a ``closed`` session event) and every main
  and sub-agent chain of that attempt ended (``frozen``/``closed``) with all the turns its end event
  counts. Then its segments are cut in the order the chains froze, the live main chain last (``final``);
  other attempts, side chains, unattributed chains and chains that ended ``ambiguous`` never train;
* a rollout that never completes is aborted by a clock fact (:func:`expire`), emitting nothing.

Terminal states (emitted, aborted, dead) are kept for a while as tombstones, so a redelivered event is
recognised as a duplicate after a crash, and a new turn or reward for a finished rollout is dead-lettered
instead of silently starting a second life. A tombstone is compact (:func:`entomb`): its turn and session
digests shrink to one 8-byte fingerprint per fact, about a fifth of the open state's size.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import orjson

from rollbus.codec import CodecError, Scanned, decode_scans, encode, scan
from rollbus.routed_experts import RoutesRef, cover
from rollbus.topics import MAX_EVENT_BYTES, spec_for, split_name
from rollbus.trajectory import ChainBroken, ChainTokens, FrozenChain, LossScope, Segment, fan_out, trains
from rollbus.turn_log import (
    ConflictingTurn,
    TurnKey,
    UnresolvedTurn,
    chain_arrays,
    describe,
    resolve_turns,
    turn_digest,
    turn_digest_v1,
    turn_key,
)

FactKind = Literal["turn", "session", "diff", "reward"]
Status = Literal["open", "emitted", "aborted", "dead"]
TRAINABLE = ("main", "subagent")
AMBIGUOUS = "ambiguous"  # a chain's end reason when its origin is unproven: it never trains
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
    seen: str = ""  # a tombstone's facts: base64 of 8-byte fingerprints (see entomb)

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
    """What one fact did (``new|duplicate|late|rejected``), a turn body to keep, why to dead-letter it."""

    verdict: str
    store: TurnKey | None = None
    dead_letter: str | None = None


class Conflict(ValueError):
    """Events of one rollout contradict each other; the rollout cannot be trusted to train."""


LOSS_SCOPES: tuple[str, ...] = get_args(LossScope)


def reward_loss_scope(record: Mapping[str, Any]) -> LossScope | None:
    """The reward's own ``details.loss_scope`` (the gym runner's ``--loss-scope``), None when it names none.

    ``details`` that is not a JSON object (a grader's note, an empty string) names none, and the
    segmenter's ``--loss-scope`` applies; a value that is not a loss scope is a Conflict, never a guess.
    """
    try:
        details = json.loads(record.get("details") or "{}")
    except ValueError:
        return None
    scope = details.get("loss_scope") if isinstance(details, dict) else None
    if scope is None:
        return None
    if scope not in LOSS_SCOPES:
        raise Conflict(f"reward details.loss_scope {scope!r} is not one of {', '.join(LOSS_SCOPES)}")
    return scope


def _digest(record: Mapping[str, Any], leave_out: tuple[str, ...] = ("schema_version",)) -> str:
    kept = {k: v for k, v in record.items() if k not in leave_out}
    return hashlib.blake2b(json.dumps(kept, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


def apply(state: RolloutState, fact: Fact) -> Step:
    """Merge ``fact`` into ``state`` (in place). A conflict turns the state ``dead`` and names the reason."""
    state.last_at = max(state.last_at, fact.at)
    try:
        if fact.kind == "turn":
            step = _turn(state, fact)
        elif fact.kind == "session":
            step = _session(state, fact.record)
        elif fact.kind == "diff":
            step = _diff(state, fact.record)
        else:
            step = _reward(state, fact.record)
    except (Conflict, ConflictingTurn) as conflict:
        kill(state, str(conflict))
        return Step("rejected", dead_letter=f"rollout {state.rollout_id} dead-lettered: {conflict}")
    if step.verdict == "duplicate":
        state.duplicates += 1
    return step


def kill(state: RolloutState, reason: str) -> None:
    state.status, state.reason = "dead", reason


FINGERPRINT = 8  # bytes; a false "duplicate" needs a 64-bit collision within one rollout's facts


def fingerprint(*identity: Any) -> bytes:
    """A fact's identity and digest in 8 bytes: what a tombstone keeps to recognise a redelivery."""
    return hashlib.blake2b(json.dumps(identity).encode(), digest_size=FINGERPRINT).digest()


def _fingerprints(state: RolloutState) -> set[bytes]:
    raw = base64.b64decode(state.seen)
    return {raw[i : i + FINGERPRINT] for i in range(0, len(raw), FINGERPRINT)}


def _remember(state: RolloutState, *prints: bytes) -> None:
    state.seen = base64.b64encode(base64.b64decode(state.seen) + b"".join(prints)).decode()


def entomb(state: RolloutState) -> None:
    """Shrink a terminal state to what late events are judged by: every turn and session digest becomes a
    fingerprint (a redelivery is still a duplicate), the reward keeps its digest and attempt only.

    Why: tombstones live ``forget_after`` (rollouts finish steadily, so they are most of the table), and
    an open state's digests cost ~60 bytes a turn. Bodies must be dropped first (they need the turn keys).
    """
    prints = [
        fingerprint("turn", attempt, chain_id, int(index), digest)
        for attempt, chains in state.attempts.items()
        for chain_id, chain in chains.items()
        for index, digest in chain.turns.items()
    ] + [fingerprint("session", identity, digest) for identity, digest in state.sessions.items()]
    _remember(state, *prints)
    state.attempts, state.sessions = {}, {}
    if state.reward is not None:
        state.reward = {"digest": state.reward["digest"], "attempt_id": state.reward["attempt_id"]}


def _finished(state: RolloutState, what: str) -> str:
    return (
        f"{what} for rollout {state.rollout_id}, which is already {state.status} ({state.reason or 'done'})"
    )


def _chain(state: RolloutState, attempt: str, chain_id: str, kind: str) -> ChainFacts:
    chain = state.attempts.setdefault(attempt, {}).setdefault(chain_id, ChainFacts(kind))
    if chain.kind != kind:
        raise Conflict(f"chain {chain_id} is {chain.kind} in one event and {kind} in another")
    return chain


def _turn(state: RolloutState, fact: Fact) -> Step:
    record = fact.record
    key, digest = turn_key(record), turn_digest(record, fact.scanned)
    attempt, chain_id, index = key
    known = state.attempts.get(attempt, {}).get(chain_id)
    seen = known.turns.get(str(index)) if known is not None else None
    if seen == digest or seen is not None and len(seen) == V1_DIGEST and seen == _v1_digest(fact):
        return Step("duplicate")
    if not state.open:
        prints = _fingerprints(state)
        if fingerprint("turn", attempt, chain_id, index, digest) in prints:
            return Step("duplicate")
        if fingerprint("turn", attempt, chain_id, index, _v1_digest(fact)) in prints:
            return Step("duplicate")
        return _late_turn(state, record, key, digest)
    if seen is not None:
        raise ConflictingTurn(f"turn {describe(key)} was sent twice with different content")
    chain = _chain(state, attempt, chain_id, record["chain_kind"])
    if chain.turn_count is not None and index >= chain.turn_count:
        raise Conflict(f"turn {describe(key)} came after its chain ended with {chain.turn_count} turns")
    chain.turns[str(index)] = digest
    return Step("new", store=key if chain.kind in TRAINABLE else None)


V1_DIGEST = 32  # hex digits of turn_digest_v1, which states kept before turn_digest v2 hold


def _v1_digest(fact: Fact) -> str:
    """The turn's digest as states written before :func:`turn_digest` v2 kept it: asked only when a turn
    does not match under v2 (a redelivery after an upgrade over a live changelog is still a duplicate)."""
    return turn_digest_v1(fact.scanned.decoded().record if fact.scanned is not None else fact.record)


def _late_turn(state: RolloutState, record: Mapping[str, Any], key: TurnKey, digest: str) -> Step:
    """A turn after the rollout finished: dead-lettered if it could have changed the segments (a trainable
    chain of the rewarded attempt), else only counted (another attempt's or a side turn that lagged)."""
    attempt, chain_id, index = key
    rewarded = state.reward is not None and state.reward["attempt_id"] == attempt
    if rewarded and record["chain_kind"] in TRAINABLE or state.status == "dead":
        return Step("late", dead_letter=_finished(state, f"turn {describe(key)}"))
    _remember(state, fingerprint("turn", attempt, chain_id, index, digest))  # a redelivery: duplicate
    return Step("late")


def _session(state: RolloutState, record: Mapping[str, Any]) -> Step:
    attempt, chain_id, kind = record.get("attempt_id", ""), record["chain_id"], record["kind"]
    identity, digest = json.dumps([attempt, chain_id, kind]), _digest(record, ("schema_version", "at"))
    seen = state.sessions.get(identity)
    if seen == digest:
        return Step("duplicate")
    if not state.open:
        late = fingerprint("session", identity, digest)
        if late in _fingerprints(state):
            return Step("duplicate")
        _remember(state, late)
        return Step("late")
    if seen is not None:
        raise Conflict(f"session event {kind} of chain {chain_id} was sent twice with different content")
    state.sessions[identity] = digest
    chain = _chain(state, attempt, chain_id, record["chain_kind"])
    if kind == "opened":
        return Step("new")
    count = record["turn_count"]
    if chain.turn_count is not None and chain.turn_count != count:
        raise Conflict(f"chain {chain_id} ended with {chain.turn_count} turns, then with {count}")
    beyond = [int(i) for i in chain.turns if int(i) >= count]
    if beyond:
        raise Conflict(f"chain {chain_id} ended with {count} turns but turn {min(beyond)} exists")
    state.seq += 1
    if chain.end is None:
        chain.end, chain.turn_count, chain.end_seq = kind, count, state.seq
        chain.ambiguous = record.get("reason") == AMBIGUOUS
    if kind == "closed":
        chain.closed_seq = state.seq
        if attempt not in state.closed:
            state.closed.append(attempt)
    return Step("new")


def _diff(state: RolloutState, record: Mapping[str, Any]) -> Step:
    attempt, digest = record.get("attempt_id", ""), _digest(record)
    seen = state.diffs.get(attempt)
    if seen is not None:
        return Step("duplicate" if seen[0] == digest else "late")
    state.diffs[attempt] = [digest, record.get("group_id", ""), record.get("group_size", 1)]
    return Step("new")


def _reward(state: RolloutState, record: Mapping[str, Any]) -> Step:
    digest = _digest(record)
    if state.reward is not None and state.reward["digest"] == digest:
        return Step("duplicate")
    if not state.open:
        return Step("late", dead_letter=_finished(state, "reward"))
    if state.reward is not None:
        first = state.reward["attempt_id"]
        reason = f"rollout {state.rollout_id} already has a reward (attempt {first!r}); this one is ignored"
        return Step("rejected", dead_letter=reason)
    scope = reward_loss_scope(record)
    state.reward = {
        "digest": digest, "attempt_id": record.get("attempt_id", ""), "reward": float(record["reward"]),
        "group_id": record.get("group_id", ""), "group_size": record.get("group_size", 1), "at": record["at"],
        "loss_scope": scope, "infos": record.get("infos") or "[]",
    }  # fmt: skip
    return Step("new")


# --- completion -----------------------------------------------------------------------------------


def missing(state: RolloutState) -> list[str]:
    """What the rollout still waits for before it can be segmented; empty when it is complete."""
    if state.reward is None:
        return ["no reward"]
    attempt = state.reward["attempt_id"]
    gaps = [] if attempt in state.closed else [f"attempt {attempt!r} never closed"]
    for chain_id, chain in state.attempts.get(attempt, {}).items():
        if chain.kind not in TRAINABLE:
            continue
        if chain.end is None:
            gaps.append(f"chain {chain_id} never ended ({len(chain.turns)} turns seen)")
            continue
        absent = [i for i in range(chain.turn_count or 0) if str(i) not in chain.turns]
        if absent:
            gaps.append(f"chain {chain_id} lacks turn(s) {', '.join(map(str, absent[:5]))}")
    return gaps


def complete(state: RolloutState) -> bool:
    """``state.open and not missing(state)``, asked on every event: a chain still short of turns is seen
    from its count alone, so a reward that arrives before a long chain's turns (another topic, read in any
    order) does not make each later turn walk every turn index."""
    if not state.open or state.reward is None or state.reward["attempt_id"] not in state.closed:
        return False
    for chain in state.attempts.get(state.reward["attempt_id"], {}).values():
        if chain.kind not in TRAINABLE:
            continue
        count = chain.turn_count or 0
        if chain.end is None or len(chain.turns) < count:
            return False
        if any(str(index) not in chain.turns for index in range(count)):
            return False
    return True


def freeze_order(state: RolloutState) -> list[tuple[str, str]]:
    """``(chain id, segment kind)`` of the rewarded attempt's trainable chains in the order they froze.

    The ``sessions`` events give the order; the main chain closed last is the ``final`` tail, every other
    main chain was cut by a history rewrite (``wipe``), sub-agent chains are ``subagent``.
    """
    attempt = state.reward["attempt_id"] if state.reward else ""
    chains = {
        c: f
        for c, f in state.attempts.get(attempt, {}).items()
        if f.kind in TRAINABLE and f.turn_count and not f.ambiguous
    }
    closed_mains = [c for c, f in chains.items() if f.kind == "main" and f.closed_seq is not None]
    final = max(closed_mains, key=lambda c: chains[c].closed_seq) if closed_mains else None
    order = sorted((c for c in chains if c != final), key=lambda c: chains[c].end_seq)
    kinds = [(c, "subagent" if chains[c].kind == "subagent" else "wipe") for c in order]
    return kinds + ([(final, "final")] if final is not None else [])


class _Stitched(FrozenChain):
    """A frozen chain whose token sequences were already stitched from the reference encoding."""

    def __init__(self, kind: str, chain_id: str, sequences: list[ChainTokens]) -> None:
        super().__init__(kind, [], chain_id=chain_id)  # type: ignore[arg-type]
        self._sequences = sequences

    def sequences(self) -> list[ChainTokens]:
        return self._sequences


def segment_id(rollout_id: str, attempt_id: str, index: int) -> str:
    """Deterministic: a replay, a restart or a second worker cuts the same ids, so consumers deduplicate."""
    return f"{rollout_id}/{attempt_id}/{index}"


def cut(
    state: RolloutState,
    bodies: Callable[[list[TurnKey]], Sequence[Mapping[str, Any]]],
    *,
    loss_scope: LossScope = "all_turns",
    history_mode: str = "canonical",
) -> list[dict[str, Any]]:
    """The complete rollout's ``segment`` records. Raises UnresolvedTurn/ChainBroken on a bad chain.

    ``bodies`` gives the turn records of a list of turn keys, all asked at once (so a reader of raw
    bytes decodes a rollout's turns in one batch). Canonical chains are cut as numpy arrays, ids given as
    :class:`~rollbus.codec.Varints` spliced as bytes (:func:`~rollbus.turn_log.chain_arrays`): the codec
    encodes both as it encodes lists, and checks them as strictly.

    ``loss_scope`` is the default; a reward that names its own (``details.loss_scope``) wins, so one
    segmenter serves coding-agent rollouts and gym episodes run with ``--loss-scope last_turn``.
    """
    reward = state.reward
    assert reward is not None, "cut() needs a rewarded rollout"
    loss_scope = reward.get("loss_scope") or loss_scope
    attempt = reward["attempt_id"]
    order = freeze_order(state)
    keys = [
        (attempt, chain_id, i)
        for chain_id, _ in order
        for i in range(state.attempts[attempt][chain_id].turn_count or 0)
    ]
    by_key = dict(zip(keys, bodies(keys), strict=True))
    chains, routes = [], {}
    for chain_id, kind in order:
        count = state.attempts[attempt][chain_id].turn_count or 0
        records = [by_key[(attempt, chain_id, i)] for i in range(count)]
        if history_mode == "rerender":
            rerendered = FrozenChain(kind, resolve_turns(records), "rerender", chain_id)  # type: ignore[arg-type]
            sequences = rerendered.sequences()
        else:
            tokens = chain_arrays(records)
            sequences = [tokens] if trains(tokens) else []
            routes[chain_id] = chain_routes(records, len(tokens.prompt_ids) + len(tokens.response_ids))
        chains.append(_Stitched(kind, chain_id, sequences))
    segments = fan_out(chains, state.rollout_id, reward["reward"], loss_scope=loss_scope)
    return [segment_record(s, state, attempt, routes.get(s.chain_id or "")) for s in segments]


def chain_routes(records: Sequence[Mapping[str, Any]], tokens: int) -> list[dict[str, Any]] | None:
    """A canonical chain's turns' routed-expert references if together they cover its ``tokens``-token
    stream (:func:`~rollbus.routed_experts.cover`), else None: the trainer then routes on its own. Only the
    references are read; the ids stay in the store."""
    found = [record.get("routed_experts") for record in records]
    if not found or any(ref is None for ref in found):
        return None
    refs = [RoutesRef.of(ref) for ref in found]
    return [ref.as_record() for ref in refs] if cover(refs, tokens) is not None else None


def group_of(state: RolloutState, attempt: str) -> str:
    """The reward's group, else the diff's, else the rollout alone (a group of one has no advantage)."""
    reward = state.reward or {}
    diff = state.diffs.get(attempt)
    return reward.get("group_id") or (diff[1] if diff else "") or state.rollout_id


def segment_record(
    segment: Segment, state: RolloutState, attempt: str, routes: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The Avro ``segment`` record; ``created_at`` is the reward's time, so a replay is byte-identical. The
    reward's gym ``infos`` ride on the ``final`` segment only, so the trainer logs them once per rollout.
    ``routes``: its chain's routed-expert references (:func:`chain_routes`)."""
    return {
        "segment_id": segment_id(state.rollout_id, attempt, segment.index),
        "rollout_id": state.rollout_id,
        "group_id": group_of(state, attempt),
        "index": segment.index,
        "num_segments": segment.num_segments,
        "kind": segment.kind,
        "prompt_ids": segment.prompt_ids,
        "response_ids": segment.response_ids,
        "loss_mask": bytes(segment.loss_mask),
        "rollout_logprobs": segment.rollout_logprobs,
        "reward": segment.reward,
        "trajectory_reward": segment.trajectory_reward,
        "policy_versions": segment.policy_versions,
        "created_at": int(state.reward["at"]) if state.reward else 0,
        "attempt_id": attempt,
        "chain_id": segment.chain_id or "",
        "infos": _infos(state) if segment.kind == "final" else "[]",
        "routed_experts": routes,
    }


def _infos(state: RolloutState) -> str:
    """The reward's gym info dicts, verbatim (a replay cuts the same bytes); "[]" from a state kept before
    segments carried them."""
    return (state.reward or {}).get("infos") or "[]"


def expire(state: RolloutState, now: int, timeout_ms: int, forget_after_ms: int) -> str | None:
    """A clock fact: ``"abort"`` an open rollout idle for ``timeout_ms`` (reason set), ``"forget"`` a
    finished one (its tombstone) after ``forget_after_ms``; None if nothing is due."""
    idle = now - state.last_at
    if state.open and idle >= timeout_ms:
        state.status = "aborted"
        gaps = "; ".join(missing(state) or ["incomplete"])
        state.reason = f"timed out after {idle / 1000:.0f}s idle: {gaps}"
        return "abort"
    if not state.open and idle >= forget_after_ms:
        return "forget"
    return None


# --- the driver: states and bodies in any mutable mappings (dicts, Faust tables) --------------------


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
    verdict: str
    segments: list[dict[str, Any]] = field(default_factory=list)
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
        self.count(step.verdict)
        if step.store is not None:
            key = body_key(rollout_id, step.store)
            self.bodies[key] = raw
            if fact.scanned is not None and fact.scanned.data == raw:
                self._scans[key] = fact.scanned
        outcome = Handled(rollout_id, step.verdict, dead_letter=step.dead_letter)
        if complete(state):
            self._cut(state, outcome)
        if was_open and state.status == "dead":
            outcome.finished = "dead"
            self.count("dead")
            self._drop_bodies(state)
            entomb(state)
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
        """After the outcome's segments are acknowledged: the rollout's tombstone, its bodies deleted."""
        if outcome.finished != "emitted":
            return
        state = self.load(outcome.rollout_id)
        if not state.open:
            return
        state.status, state.reason = "emitted", f"{len(outcome.segments)} segment(s)"
        self._drop_bodies(state)
        entomb(state)
        self._store(state)
        self.count("emitted")
        self.count("segments", len(outcome.segments))

    def tick(self, now: int, partition: int | None = None) -> list[RolloutState]:
        """Abort rollouts idle past the timeout (returned, for counting) and forget old tombstones."""
        aborted = []
        for state in self._due(now, partition):
            verdict = expire(state, now, self.options.timeout_ms, self.options.forget_after_ms)
            if verdict == "abort":
                self._drop_bodies(state)
                entomb(state)
                self._store(state)
                self.count("aborted")
                aborted.append(state)
            elif verdict == "forget":
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


# --- from the wire ----------------------------------------------------------------------------------


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
