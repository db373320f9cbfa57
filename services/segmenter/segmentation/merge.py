"""Merging one fact into a rollout's state: identity and digest (a retry is dropped, a conflict kills the
rollout), and the compact record a finished rollout leaves behind (:func:`seal`) to recognise
redeliveries."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any, get_args

from rollbus.events import DiffEvent, Identity, RewardEvent, SessionEvent, content_digest, spec
from rollbus.failures import INFRASTRUCTURE
from rollbus.services.segmenter.segmentation.state import (
    TRAINABLE,
    ChainFacts,
    Conflict,
    Fact,
    RolloutState,
    Step,
)
from rollbus.trajectory import AMBIGUOUS, LossScope
from rollbus.turn_log import (
    ConflictingTurn,
    TurnKey,
    describe,
    turn_digest,
    turn_digest_v1,
    turn_key,
)

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
    """Every field but ``leave_out``: what states kept before identity was declared per event type."""
    return content_digest(Identity((), leave_out), record)


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
    if step.admission == "duplicate":
        state.duplicates += 1
    return step


def infrastructure_failed(state: RolloutState) -> bool:
    """Whether the rollout's reward says the infrastructure failed it (:mod:`rollbus.failures`): it is cut
    at once into one marker segment, and nothing of its turns ever trains."""
    return (state.reward or {}).get("failure_class") == INFRASTRUCTURE


def kill(state: RolloutState, reason: str) -> None:
    state.status, state.reason = "dead", reason


FINGERPRINT = 8  # bytes; a false "duplicate" needs a 64-bit collision within one rollout's facts


def fingerprint(*identity: Any) -> bytes:
    """A fact's identity and digest in 8 bytes: what a sealed state keeps to recognise a redelivery."""
    return hashlib.blake2b(json.dumps(identity).encode(), digest_size=FINGERPRINT).digest()


def _fingerprints(state: RolloutState) -> set[bytes]:
    raw = base64.b64decode(state.seen)
    return {raw[i : i + FINGERPRINT] for i in range(0, len(raw), FINGERPRINT)}


def _remember(state: RolloutState, *prints: bytes) -> None:
    state.seen = base64.b64encode(base64.b64decode(state.seen) + b"".join(prints)).decode()


def seal(state: RolloutState) -> None:
    """Shrink a terminal state to what late events are judged by: every turn and session digest becomes a
    fingerprint (a redelivery is still a duplicate), the reward keeps its digest and attempt only.

    Why: sealed states live ``forget_after`` (rollouts finish steadily, so they are most of the table), and
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
        state.reward = {
            "digest": state.reward["digest"], "attempt_id": state.reward["attempt_id"],
            **({"failure_class": INFRASTRUCTURE} if infrastructure_failed(state) else {}),
        }  # fmt: skip


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
    rewarded = rewarded and not infrastructure_failed(state)  # its turns never train: a late one is harmless
    if rewarded and record["chain_kind"] in TRAINABLE or state.status == "dead":
        return Step("late", dead_letter=_finished(state, f"turn {describe(key)}"))
    _remember(state, fingerprint("turn", attempt, chain_id, index, digest))  # a redelivery: duplicate
    return Step("late")


def _session(state: RolloutState, record: Mapping[str, Any]) -> Step:
    session = SessionEvent.from_dict(record)
    attempt, chain_id, kind = session.attempt_id, session.chain_id, session.kind
    identity, digest = json.dumps([attempt, chain_id, kind]), content_digest(spec("session").identity, record)
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
    chain = _chain(state, attempt, chain_id, session.chain_kind)
    if kind == "opened":
        return Step("new")
    count = session.turn_count
    if chain.turn_count is not None and chain.turn_count != count:
        raise Conflict(f"chain {chain_id} ended with {chain.turn_count} turns, then with {count}")
    beyond = [int(i) for i in chain.turns if int(i) >= count]
    if beyond:
        raise Conflict(f"chain {chain_id} ended with {count} turns but turn {min(beyond)} exists")
    state.seq += 1
    if chain.end is None:
        chain.end, chain.turn_count, chain.end_seq = kind, count, state.seq
        chain.ambiguous = session.reason == AMBIGUOUS
    if kind == "closed":
        chain.closed_seq = state.seq
        if attempt not in state.closed:
            state.closed.append(attempt)
    return Step("new")


def _diff(state: RolloutState, record: Mapping[str, Any]) -> Step:
    diff = DiffEvent.from_dict(record)
    attempt, digest = diff.attempt_id, content_digest(spec("diff").identity, record)
    seen = state.diffs.get(attempt)
    if seen is not None:
        return Step("duplicate" if seen[0] == digest else "late")
    state.diffs[attempt] = [digest, diff.group_id, diff.group_size]
    return Step("new")


def reward_digest(record: Mapping[str, Any]) -> str:
    """A reward's content: its verdict, not when or how verbosely it was written (the reward's declared
    :class:`~rollbus.events.Identity`: a diff graded again after a grader crash is a duplicate)."""
    return content_digest(spec("reward").identity, record)


def _reward(state: RolloutState, record: Mapping[str, Any]) -> Step:
    digest = reward_digest(record)
    legacy = _digest(record)  # what states kept before rewards were identified by their verdict
    if state.reward is not None and state.reward["digest"] in (digest, legacy):
        return Step("duplicate")
    if not state.open:
        return Step("late", dead_letter=_finished(state, "reward"))
    if state.reward is not None:
        first = state.reward["attempt_id"]
        reason = f"rollout {state.rollout_id} already has a reward (attempt {first!r}); this one is ignored"
        return Step("rejected", dead_letter=reason)
    scope = reward_loss_scope(record)
    reward = RewardEvent.from_dict(record)
    state.reward = {
        "digest": digest, "attempt_id": reward.attempt_id, "reward": float(reward.reward),
        "group_id": reward.group_id, "group_size": reward.group_size, "at": reward.at,
        "loss_scope": scope, "infos": reward.infos or "[]",
        "failure_class": reward.failure_class, "failure_cause": reward.failure_cause,
        "rerun_rollout_id": reward.rerun_rollout_id,
    }  # fmt: skip
    return Step("new")
