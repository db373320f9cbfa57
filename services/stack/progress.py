"""What a running stack has done, folded from the bus: the demo's live view and its JSON summary.

:class:`Progress` is a plain fold over decoded events (no I/O), so what the demo reports is exactly what the
topics say; :func:`watch` feeds it from the broker. A run continued on its topics counts only what it did:
events older than its start are earlier runs' (only their policy version is kept, as the base its steps
count from).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rollbus.codec import CodecError, decode
from rollbus.events import (
    BadRecord,
    DiffEvent,
    EventRecord,
    PolicyEvent,
    RewardEvent,
    SegmentEvent,
    TaskEvent,
    TurnEvent,
)
from rollbus.failures import INFRASTRUCTURE
from rollbus.kafka import clients
from rollbus.kafka.topics import topic_name

WATCHED = ("tasks", "turns", "diffs", "rewards", "segments", "policy")


@dataclass
class Progress:
    submitted: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)  # rollouts with turns but no diff yet
    diffs: dict[str, DiffEvent] = field(default_factory=dict)  # latest diff per rollout
    rewards: dict[str, RewardEvent] = field(default_factory=dict)  # latest reward per rollout
    segment_ids: set[str] = field(default_factory=set)
    duplicates_dropped: int = 0
    tokens_in_segments: int = 0
    policy_version: int = 0
    policy_base: int = 0  # the newest version published before this run started
    policy_updates: int = 0  # versions published by this run
    turns: int = 0
    turn_policy_versions: list[int] = field(default_factory=list)  # version of each turn, in bus order
    undecodable: int = 0
    reruns: set[str] = field(default_factory=set)  # rollouts submitted as re-runs of infrastructure failures
    refills: dict[str, str] = field(default_factory=dict)  # trainer-submitted group -> why it replaces one

    def add(self, event: EventRecord) -> None:
        match event:
            case TaskEvent():
                self.submitted.add(event.rollout_id)
                if event.attempt > 0:
                    self.reruns.add(event.rollout_id)
                elif event.refill_of:
                    self.refills[event.group_id] = str(event.refill_reason)
            case TurnEvent():
                self.turns += 1
                self.turn_policy_versions.append(event.policy_version)
                if event.rollout_id not in self.diffs:
                    self.running.add(event.rollout_id)
            case DiffEvent():
                self.diffs[event.rollout_id] = event
                self.running.discard(event.rollout_id)
            case RewardEvent():
                self.rewards[event.rollout_id] = event
            case SegmentEvent():
                if event.segment_id in self.segment_ids:
                    self.duplicates_dropped += 1
                    return
                self.segment_ids.add(event.segment_id)
                self.tokens_in_segments += sum(event.loss_mask)
            case PolicyEvent():
                if event.version > self.policy_base:  # the initial policy (or an earlier run's) is no step
                    self.policy_updates += 1
                self.policy_version = max(self.policy_version, event.version)

    def earlier(self, event: EventRecord) -> None:
        """An earlier run's event on the same topics: not counted; its policy is where this run starts."""
        if isinstance(event, PolicyEvent):
            self.policy_base = max(self.policy_base, event.version)
            self.policy_version = max(self.policy_version, self.policy_base)

    @property
    def finished(self) -> int:
        """Rollouts graded (or failed before grading: every failure still ends in a reward)."""
        return len(self.rewards)

    @property
    def failed(self) -> int:
        """Rollouts whose run failed (boot, crash, limit, timeout ...), not those that did not solve."""
        return sum(1 for d in self.diffs.values() if d.failure_kind)

    def infrastructure_causes(self) -> dict[str, int]:
        """Rollouts the infrastructure failed (``rollbus.failures``), by cause: they never train."""
        failed = [r for r in self.rewards.values() if r.failure_class == INFRASTRUCTURE]
        causes = Counter(str(r.failure_cause) for r in failed)
        return dict(sorted(causes.items()))

    @property
    def solved(self) -> int:
        return sum(1 for r in self.rewards.values() if r.solved)

    def summary(self, *, train_steps: int, tokens_trained: int | None = None) -> dict[str, Any]:
        return {
            "rollouts_submitted": len(self.submitted),
            "rollouts_finished": self.finished,
            "rollouts_failed": self.failed,
            "solved": self.solved,
            "segments": len(self.segment_ids),
            "train_steps": train_steps,
            "policy_version": self.policy_version,
            "tokens_trained": self.tokens_in_segments if tokens_trained is None else tokens_trained,
            "duplicates_dropped": self.duplicates_dropped,
            "infrastructure_failures": sum(self.infrastructure_causes().values()),
            "infrastructure_failure_causes": self.infrastructure_causes(),
            "reruns": len(self.reruns),
            "refills": len(self.refills),
            "refill_reasons": dict(sorted(Counter(self.refills.values()).items())),
        }

    def line(self) -> str:
        served = max(self.turn_policy_versions, default=0)
        return (
            f"rollouts {len(self.submitted)} submitted, {len(self.running)} running, "
            f"{self.finished} finished ({self.solved} solved, {self.failed} failed, "
            f"{sum(self.infrastructure_causes().values())} by the infrastructure; "
            f"{len(self.reruns)} re-runs, {len(self.refills)} groups refilled) | "
            f"segments {len(self.segment_ids)} | "
            f"policy v{self.policy_version} ({self.policy_updates} updates), turns served by v{served}"
        )


def fold(events: Iterable[EventRecord]) -> Progress:
    progress = Progress()
    for event in events:
        progress.add(event)
    return progress


async def watch(
    bootstrap: str, namespace: str, progress: Progress, stop: asyncio.Event, poll_ms: int = 500,
    since_ms: int = 0,
) -> None:
    """Fold every watched topic from its beginning into ``progress`` until ``stop`` is set; events stamped
    before ``since_ms`` (an earlier run's) go to :meth:`Progress.earlier`."""
    topics = [topic_name(base, namespace) for base in WATCHED]
    # no group: every partition of every topic is ours, read from its beginning
    consumer = clients.consumer(
        bootstrap, *topics, client_id="rollbus-progress", auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        while not stop.is_set():
            batches = await consumer.getmany(timeout_ms=poll_ms)
            for messages in batches.values():
                for message in messages:
                    try:
                        event = decode(message.value).event
                    except (CodecError, BadRecord):
                        progress.undecodable += 1
                        continue
                    if message.timestamp < since_ms:
                        progress.earlier(event)
                    else:
                        progress.add(event)
    finally:
        await consumer.stop()
