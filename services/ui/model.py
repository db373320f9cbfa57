"""The UI's read model: a fold over decoded events (plain data in, plain data out, no I/O).

Every message read is kept with where it was (topic, partition, offset) so the topic browser needs no second
read, and the per-rollout view is built from those records on demand. The fold is indifferent to the order
in which *topics* arrive (the feed reads them concurrently, a rebuild one after another): per-rollout state
is keyed by what identifies it (each event's declared identity, rollbus.events: chain and turn index, segment
id, policy version, step), and "latest" only ever compares events of
one partition, whose order Kafka keeps. So a model folded live equals one rebuilt from scratch.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rollbus.events import (
    BadRecord,
    DiffEvent,
    EventRecord,
    PolicyEvent,
    RewardEvent,
    SegmentEvent,
    SessionEvent,
    TaskEvent,
    TrainStepEvent,
    TurnEvent,
    event_class,
)
from rollbus.kafka.topics import DEAD_LETTERS, split_name


@dataclass(frozen=True)
class Entry:
    """One message as the topic browser shows it: its place, key, and event (or why it did not decode)."""

    topic: str  # base name (turns, segments, ...)
    partition: int
    offset: int
    timestamp: int
    key: str | None
    event_type: str | None
    record: dict[str, Any] | None
    error: str | None = None


@dataclass
class Rollout:
    """Everything the bus says about one rollout."""

    rollout_id: str
    task: TaskEvent | None = None
    turns: dict[tuple[str, str, int], TurnEvent] = field(default_factory=dict)  # (attempt, chain, index)
    sessions: list[SessionEvent] = field(default_factory=list)  # in partition order
    diff: DiffEvent | None = None  # the latest
    reward: RewardEvent | None = None  # the latest
    segments: dict[str, SegmentEvent] = field(default_factory=dict)  # segment id -> first seen

    @property
    def status(self) -> str:
        """submitted | running | failed (the run failed) | finished (graded)."""
        if self.diff is not None and self.diff.failure_kind:
            return "failed"
        if self.reward is not None:
            return "finished"
        if self.turns or self.diff is not None:
            return "running"
        return "submitted"

    @property
    def policy_version(self) -> int | None:
        """The newest policy version that sampled one of its turns."""
        return max((t.policy_version for t in self.turns.values()), default=None)


@dataclass
class ReadModel:
    """The whole UI state: rollouts by id, policy versions, train steps, dead letters and the raw log per
    topic."""

    rollouts: dict[str, Rollout] = field(default_factory=dict)
    policies: dict[int, PolicyEvent] = field(default_factory=dict)  # version -> first published
    steps: dict[int, Entry] = field(default_factory=dict)  # step -> its first fact on train-steps
    trained_in: dict[str, int] = field(default_factory=dict)  # segment id -> the (first) step that trained it
    dead_letters: list[Entry] = field(default_factory=list)
    log: dict[str, list[Entry]] = field(default_factory=dict)  # base topic -> entries by (partition, offset)
    duplicate_segments: int = 0

    def add(self, entry: Entry) -> None:
        """Fold one message (decoded or not) in."""
        _place(self.log.setdefault(entry.topic, []), entry)
        if entry.record is None:
            return
        if entry.topic == DEAD_LETTERS:
            self.dead_letters.append(entry)
            return
        try:
            event = event_class(entry.event_type or "").from_dict(entry.record)
        except (KeyError, BadRecord):  # not an event of ours: the topic browser still shows it
            return
        match event:
            case PolicyEvent():
                self.policies.setdefault(event.version, event)
            case TrainStepEvent():
                self._step(entry, event)
            case TaskEvent() | TurnEvent() | SessionEvent() | DiffEvent() | RewardEvent() | SegmentEvent():
                rollout = self.rollouts.setdefault(event.rollout_id, Rollout(event.rollout_id))
                if _fold(rollout, event) is False:
                    self.duplicate_segments += 1

    def _step(self, entry: Entry, fact: TrainStepEvent) -> None:
        """A restarted trainer may publish a step twice (the same record): the first is kept. A segment
        named by two steps (which the trainer never does) shows the earlier, whatever order they came in."""
        step = fact.step
        if step in self.steps:
            return
        self.steps[step] = entry
        for segment_id in fact.segment_ids:
            self.trained_in[segment_id] = min(step, self.trained_in.get(segment_id, step))

    def rollout(self, rollout_id: str) -> Rollout | None:
        return self.rollouts.get(rollout_id)

    def events(self) -> int:
        return sum(len(entries) for entries in self.log.values())


def _place(entries: list[Entry], entry: Entry) -> None:
    """Keep a topic's entries in (partition, offset) order, however its partitions were interleaved."""
    if not entries or (entries[-1].partition, entries[-1].offset) < (entry.partition, entry.offset):
        entries.append(entry)
    else:
        bisect.insort(entries, entry, key=lambda e: (e.partition, e.offset))


def _fold(rollout: Rollout, event: EventRecord) -> bool:
    """Fold one of the rollout's events in; False for a segment already seen (a redelivery: the first one
    is what the trainer kept)."""
    match event:
        case TaskEvent():
            rollout.task = event
        case TurnEvent():
            rollout.turns[(event.attempt_id, event.chain_id, event.turn_index)] = event
        case SessionEvent():
            rollout.sessions.append(event)
        case DiffEvent():
            rollout.diff = event
        case RewardEvent():
            rollout.reward = event
        case SegmentEvent():
            if event.segment_id in rollout.segments:
                return False
            rollout.segments[event.segment_id] = event
    return True


def base_topic(topic: str) -> str:
    """``t42.turns`` -> ``turns``."""
    return split_name(topic)[1]


def fold(entries: list[Entry]) -> ReadModel:
    model = ReadModel()
    for entry in entries:
        model.add(entry)
    return model


# --- what the overview shows ----------------------------------------------------------------------

LAST_STEP_KEYS = (
    "step", "version", "staleness_mean", "staleness_max", "logprob_diff_mean", "logprob_diff_max",
    "approx_kl", "ratio_outside_fraction", "masked_fraction", "loss",
)  # fmt: skip


def trained_tokens(segment: SegmentEvent) -> int:
    """Response tokens with loss mask 1."""
    return sum(segment.loss_mask)


def drift_masked_tokens(segment: SegmentEvent) -> int:
    """Sampled tokens (a policy version, not -1) that carry mask 0: cut from training by drift."""
    versions = segment.policy_versions
    return sum(1 for m, v in zip(segment.loss_mask, versions, strict=False) if not m and v >= 0)


def overview(model: ReadModel) -> dict[str, Any]:
    """The overview's figures, as JSON-ready plain data."""
    rollouts = list(model.rollouts.values())
    status = Counter(r.status for r in rollouts)
    failures = Counter(
        (r.diff.failure_kind if r.diff else None) or r.reward.failure_kind or "unsolved"
        for r in rollouts
        if r.reward is not None and not r.reward.solved
    )
    per_version: dict[int, list[RewardEvent]] = {}
    for r in rollouts:
        if r.reward is not None and r.policy_version is not None:
            per_version.setdefault(r.policy_version, []).append(r.reward)
    segments = [s for r in rollouts for s in r.segments.values()]
    response = sum(len(s.response_ids) for s in segments)
    trainable = sum(trained_tokens(s) for s in segments)
    versions = sorted(model.policies)
    facts = step_facts(model)
    return {
        "rollouts": {
            "submitted": sum(1 for r in rollouts if r.task is not None),
            "running": status["running"],
            "finished": status["finished"],
            "failed": status["failed"],
        },
        "failure_kinds": dict(sorted(failures.items())),
        # whose fault (rollbus.failures): infrastructure failures never train; their re-runs are new rollouts
        "failure_classes": dict(sorted(Counter(
            r.reward.failure_class for r in rollouts if r.reward is not None and r.reward.failure_class
        ).items())),
        "reruns": sum(1 for r in rollouts if r.task is not None and r.task.attempt > 0),
        "per_version": [
            {
                "version": v,
                "rollouts": len(rewards),
                "reward_mean": sum(reward.reward for reward in rewards) / len(rewards),
                "solve_rate": len([reward for reward in rewards if reward.solved]) / len(rewards),
            }
            for v, rewards in sorted(per_version.items())
        ],
        "policy_version": versions[-1] if versions else None,
        "train_steps": len(facts),
        "tokens_trained": sum(int(f["tokens_trained"]) for f in facts),
        "last_step": {k: facts[-1][k] for k in LAST_STEP_KEYS} if facts else None,
        "segments": len(segments),
        "segments_trained": sum(1 for s in segments if s.segment_id in model.trained_in),
        "response_tokens": response,
        "trainable_tokens": trainable,
        "untrained_fraction": (response - trainable) / response if response else 0.0,
        "drift_masked_tokens": sum(drift_masked_tokens(s) for s in segments),
        "duplicate_segments": model.duplicate_segments,
        "dead_letters": len(model.dead_letters),
        "undecodable": sum(1 for entries in model.log.values() for e in entries if e.error is not None),
        "events": {topic: len(entries) for topic, entries in sorted(model.log.items())},
    }


def throughput(model: ReadModel, now_ms: int, window_ms: int = 60_000) -> dict[str, float]:
    """Events per second each topic received over the last ``window_ms`` before ``now_ms`` (by the broker's
    timestamps)."""
    since = now_ms - window_ms
    return {
        topic: sum(1 for e in entries if since < e.timestamp <= now_ms) * 1000 / window_ms
        for topic, entries in sorted(model.log.items())
    }


def step_facts(model: ReadModel) -> list[dict[str, Any]]:
    """The trainer's facts on ``train-steps``, one per step, in step order."""
    # a step's entry is made from its record (ReadModel._step): never None here
    return [model.steps[step].record for step in sorted(model.steps)]  # type: ignore[misc]


def trained_by(model: ReadModel, rollout: Rollout) -> list[Entry]:
    """The ``train-steps`` entries of the steps that trained the rollout's segments (as the trainer says),
    in step order; none while no step has."""
    steps = {model.trained_in[s] for s in rollout.segments if s in model.trained_in}
    return [model.steps[step] for step in sorted(steps)]


def policy_offset(model: ReadModel, version: int) -> int | None:
    """Where on ``policy`` that version was published (for a link to it)."""
    for entry in model.log.get("policy", []):
        if entry.record is not None and int(entry.record["version"]) == version:
            return entry.offset
    return None
