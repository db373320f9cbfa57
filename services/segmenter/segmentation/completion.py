"""When a rollout is complete, and its cut: the rewarded attempt's chains in the order they froze, the live
main chain last, each segment's record with its share of the reward; :func:`expire` for rollouts that never
complete."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollbus.events import RoutedExperts, SegmentEvent
from rollbus.routed_experts import RoutesRef, cover
from rollbus.services.segmenter.segmentation.merge import infrastructure_failed
from rollbus.services.segmenter.segmentation.state import TRAINABLE, RolloutState
from rollbus.top_logprobs import chain_top_logprobs
from rollbus.trajectory import ChainTokens, FrozenChain, LossScope, Segment, SegmentKind, fan_out, trains
from rollbus.turn_log import (
    TurnKey,
    chain_arrays,
    resolve_turns,
)


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
    if state.open and infrastructure_failed(state):
        return True  # nothing of it trains: its marker need not wait for its sessions or turns
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


def freeze_order(state: RolloutState) -> list[tuple[str, SegmentKind]]:
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
    mains = ((c, f.closed_seq) for c, f in chains.items() if f.kind == "main")
    closed_mains = {c: seq for c, seq in mains if seq is not None}
    final = max(closed_mains, key=closed_mains.__getitem__) if closed_mains else None
    order = sorted((c for c in chains if c != final), key=lambda c: chains[c].end_seq or 0)
    kinds: list[tuple[str, SegmentKind]] = [
        (c, "subagent" if chains[c].kind == "subagent" else "wipe") for c in order
    ]
    return kinds + ([(final, "final")] if final is not None else [])


class _Stitched(FrozenChain):
    """A frozen chain whose token sequences were already stitched from the reference encoding."""

    def __init__(self, kind: SegmentKind, chain_id: str, sequences: list[ChainTokens]) -> None:
        super().__init__(kind, [], chain_id=chain_id)
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
) -> list[SegmentEvent]:
    """The complete rollout's ``segment`` events. Raises UnresolvedTurn/ChainBroken on a bad chain.

    ``bodies`` gives the turn records of a list of turn keys, all asked at once (so a reader of raw
    bytes decodes a rollout's turns in one batch). Canonical chains are cut as numpy arrays, ids given as
    :class:`~rollbus.codec.Varints` spliced as bytes (:func:`~rollbus.turn_log.chain_arrays`): the codec
    encodes both as it encodes lists, and checks them as strictly.

    ``loss_scope`` is the default; a reward that names its own (``details.loss_scope``) wins, so one
    segmenter serves coding-agent rollouts and gym episodes run with ``--loss-scope last_turn``.
    """
    reward = state.reward
    assert reward is not None, "cut() needs a rewarded rollout"
    if infrastructure_failed(state):
        return [infrastructure_marker(state)]
    loss_scope = reward.get("loss_scope") or loss_scope
    attempt = reward["attempt_id"]
    order = freeze_order(state)
    keys = [
        (attempt, chain_id, i)
        for chain_id, _ in order
        for i in range(state.attempts[attempt][chain_id].turn_count or 0)
    ]
    by_key = dict(zip(keys, bodies(keys), strict=True))
    chains, routes, tops = [], {}, {}
    for chain_id, kind in order:
        count = state.attempts[attempt][chain_id].turn_count or 0
        records = [by_key[(attempt, chain_id, i)] for i in range(count)]
        if history_mode == "rerender":
            rerendered = FrozenChain(kind, resolve_turns(records), "rerender", chain_id)
            sequences = rerendered.sequences()
        else:
            tokens = chain_arrays(records)
            sequences = [tokens] if trains(tokens) else []
            routes[chain_id] = chain_routes(records, len(tokens.prompt_ids) + len(tokens.response_ids))
            tops[chain_id] = chain_top_logprobs(records, len(tokens.response_ids))
        chains.append(_Stitched(kind, chain_id, sequences))
    segments = fan_out(chains, state.rollout_id, reward["reward"], loss_scope=loss_scope)
    return [
        segment_record(s, state, attempt, routes.get(s.chain_id or ""), tops.get(s.chain_id or ""))
        for s in segments
    ]


def chain_routes(records: Sequence[Mapping[str, Any]], tokens: int) -> list[RoutedExperts] | None:
    """A canonical chain's turns' routed-expert references if together they cover its ``tokens``-token
    stream (:func:`~rollbus.routed_experts.cover`), else None: the trainer then routes on its own. Only the
    references are read; the ids stay in the store."""
    found = [record.get("routed_experts") for record in records]
    present = [ref for ref in found if ref is not None]
    if not found or len(present) < len(found):
        return None
    refs = [RoutesRef.of(ref) for ref in present]
    if cover(refs, tokens) is None:
        return None
    return [RoutedExperts.from_dict(ref.as_record()) for ref in refs]


def group_of(state: RolloutState, attempt: str) -> str:
    """The reward's group, else the diff's, else the rollout alone (a group of one has no advantage)."""
    reward = state.reward or {}
    diff = state.diffs.get(attempt)
    return reward.get("group_id") or (diff[1] if diff else "") or state.rollout_id


def segment_record(
    segment: Segment, state: RolloutState, attempt: str, routes: list[RoutedExperts] | None = None,
    top_logprobs: bytes | None = None,
) -> SegmentEvent:
    """The ``segment`` event; ``created_at`` is the reward's time, so a replay is byte-identical. The
    reward's gym ``infos`` ride on the ``final`` segment only, so the trainer logs them once per rollout.
    ``routes``: its chain's routed-expert references (:func:`chain_routes`); ``top_logprobs``: its chain's
    top-k alternatives per response token (:func:`~rollbus.top_logprobs.chain_top_logprobs`)."""
    return SegmentEvent(
        segment_id=segment_id(state.rollout_id, attempt, segment.index), rollout_id=state.rollout_id,
        group_id=group_of(state, attempt), index=segment.index, num_segments=segment.num_segments,
        kind=segment.kind, prompt_ids=segment.prompt_ids, response_ids=segment.response_ids,
        loss_mask=bytes(segment.loss_mask), rollout_logprobs=segment.rollout_logprobs, reward=segment.reward,
        trajectory_reward=segment.trajectory_reward, policy_versions=segment.policy_versions,
        created_at=int(state.reward["at"]) if state.reward else 0, attempt_id=attempt,
        chain_id=segment.chain_id or "", infos=_infos(state) if segment.kind == "final" else "[]",
        routed_experts=routes, top_logprobs=top_logprobs, **failure_fields(state),
    )  # fmt: skip


def failure_fields(state: RolloutState) -> dict[str, Any]:
    """The reward's failure class, cause and re-run, carried onto every segment of the rollout."""
    reward = state.reward or {}
    return {key: reward.get(key) for key in ("failure_class", "failure_cause", "rerun_rollout_id")}


def infrastructure_marker(state: RolloutState) -> SegmentEvent:
    """The one segment of a rollout the infrastructure failed: no tokens, so nothing to train; it tells the
    trainer the sample ended (or that ``rerun_rollout_id`` takes its place) and stays out of the group's
    mean and std."""
    reward = state.reward or {}
    attempt = reward.get("attempt_id", "")
    return SegmentEvent(
        segment_id=segment_id(state.rollout_id, attempt, 0), rollout_id=state.rollout_id,
        group_id=group_of(state, attempt), index=0, num_segments=1, kind="final", prompt_ids=[],
        response_ids=[], loss_mask=b"", rollout_logprobs=[], reward=0.0, trajectory_reward=0.0,
        policy_versions=[], created_at=int(reward.get("at", 0)), attempt_id=attempt, **failure_fields(state),
    )  # fmt: skip


def _infos(state: RolloutState) -> str:
    """The reward's gym info dicts, verbatim (a replay cuts the same bytes); "[]" from a state kept before
    segments carried them."""
    return (state.reward or {}).get("infos") or "[]"


def expire(state: RolloutState, now: int, timeout_ms: int, forget_after_ms: int) -> str | None:
    """A clock fact: ``"abort"`` an open rollout idle for ``timeout_ms`` (reason set), ``"forget"`` a
    finished one (its sealed state) after ``forget_after_ms``; None if nothing is due."""
    idle = now - state.last_at
    if state.open and idle >= timeout_ms:
        state.status = "aborted"
        gaps = "; ".join(missing(state) or ["incomplete"])
        state.reason = f"timed out after {idle / 1000:.0f}s idle: {gaps}"
        return "abort"
    if not state.open and idle >= forget_after_ms:
        return "forget"
    return None
