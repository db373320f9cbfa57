"""What a regrade changed: the rewards published then against the ones the current grader gives, per policy
version. Plain functions over the events; ``rollbus regrade`` (``regrade.py``) feeds them from the topics.

A rollout attempt belongs to the latest policy version among its turns (the policy that finished it; a
rollout whose turns span an update counts once, under the newer version), or to ``unknown`` when the log
holds none of its turns. A reward *changed* when its value differs from the one published before for the
same rollout and attempt; a diff graded now but never before (its reward was dead-lettered or lost) is
counted as ``not_graded_before`` and listed, since it changes the topic too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollbus.events import DiffEvent, RewardEvent, TurnEvent

UNKNOWN = "unknown"  # the policy version of an attempt with no turns in the log

Attempt = tuple[str, str]  # (rollout id, attempt id)


def attempt_of(event: DiffEvent | RewardEvent | TurnEvent) -> Attempt:
    return event.rollout_id, event.attempt_id


@dataclass(frozen=True)
class RewardSummary:
    """What a reward said, in the words the comparison needs."""

    reward: float
    solved: bool
    failure_kind: str | None
    flags: tuple[str, ...]

    @classmethod
    def of(cls, reward: RewardEvent) -> RewardSummary:
        return cls(reward.reward, reward.solved, reward.failure_kind, tuple(sorted(reward.flags)))

    def as_dict(self) -> dict[str, Any]:
        return {
            "reward": self.reward, "solved": self.solved, "failure_kind": self.failure_kind,
            "flags": list(self.flags),
        }  # fmt: skip


@dataclass(frozen=True)
class Change:
    """One regraded attempt whose reward differs from the published one, or that had none."""

    rollout_id: str
    attempt_id: str
    policy_version: str
    was: RewardSummary | None
    now: RewardSummary

    def as_dict(self) -> dict[str, Any]:
        return {
            "rollout_id": self.rollout_id, "attempt_id": self.attempt_id,
            "policy_version": self.policy_version,
            "was": None if self.was is None else self.was.as_dict(), "now": self.now.as_dict(),
        }  # fmt: skip


@dataclass
class VersionTally:
    """Counts for one policy version; ``flags`` and ``failure_kinds`` are those of the changed rewards now."""

    regraded: int = 0
    changed: int = 0
    lowered: int = 0
    raised: int = 0
    not_graded_before: int = 0
    reflagged: int = 0  # same reward, different flags
    flags: Counter[str] = field(default_factory=Counter)
    failure_kinds: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "regraded": self.regraded, "changed": self.changed, "lowered": self.lowered,
            "raised": self.raised, "not_graded_before": self.not_graded_before, "reflagged": self.reflagged,
            "flags": dict(sorted(self.flags.items())),
            "failure_kinds": dict(sorted(self.failure_kinds.items())),
        }  # fmt: skip


@dataclass
class Ledger:
    """Accumulates the log as it is read (turns, then the rewards published, then each regrade) and says
    what changed. Problems are lines naming where in the log something could not be regraded, and why."""

    versions: dict[Attempt, int] = field(default_factory=dict)
    published: dict[Attempt, RewardSummary] = field(default_factory=dict)
    tallies: dict[str, VersionTally] = field(default_factory=dict)
    changes: list[Change] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    regraded_attempts: set[Attempt] = field(default_factory=set)
    diffs: int = 0
    repeated: int = 0

    def turn(self, turn: TurnEvent) -> None:
        key, version = attempt_of(turn), turn.policy_version
        self.versions[key] = max(version, self.versions.get(key, version))

    def reward_published(self, reward: RewardEvent) -> None:
        """A reward from the log; a later one for the same attempt (a redelivered grade) replaces it."""
        self.published[attempt_of(reward)] = RewardSummary.of(reward)

    def problem(self, where: str, why: str) -> None:
        self.problems.append(f"{where}: {why}")

    def first_time(self, diff: DiffEvent) -> bool:
        """False for a diff whose attempt was already regraded (a redelivered diff): it is counted, not graded
        twice."""
        key = attempt_of(diff)
        if key in self.regraded_attempts:
            self.repeated += 1
            return False
        self.regraded_attempts.add(key)
        return True

    def regraded(self, reward: RewardEvent) -> None:
        """The current grader's reward for one attempt."""
        key = attempt_of(reward)
        version = str(self.versions[key]) if key in self.versions else UNKNOWN
        tally = self.tallies.setdefault(version, VersionTally())
        tally.regraded += 1
        was, now = self.published.get(key), RewardSummary.of(reward)
        if was is not None and was.reward == now.reward:
            tally.reflagged += was.flags != now.flags
            return
        if was is None:
            tally.not_graded_before += 1
        else:
            tally.changed += 1
            tally.lowered += now.reward < was.reward
            tally.raised += now.reward > was.reward
            tally.flags.update(now.flags)
            tally.failure_kinds.update([now.failure_kind or "solved"])
        self.changes.append(Change(key[0], key[1], version, was, now))

    def report(self) -> dict[str, Any]:
        changes = sorted(
            self.changes, key=lambda c: (version_order(c.policy_version), c.rollout_id, c.attempt_id)
        )
        return {
            "diffs": self.diffs,
            "regraded": sum(t.regraded for t in self.tallies.values()),
            "changed": sum(t.changed for t in self.tallies.values()),
            "repeated_diffs": self.repeated,
            "policy_versions": {
                v: self.tallies[v].as_dict() for v in sorted(self.tallies, key=version_order)
            },
            "changes": [c.as_dict() for c in changes],
            "problems": list(self.problems),
        }


def version_order(version: str) -> tuple[int, int]:
    return (1, 0) if version == UNKNOWN else (0, int(version))


def report_lines(report: Mapping[str, Any]) -> list[str]:
    """The report for a reader: a summary, one line per policy version, one per change and per problem."""
    lines = [
        f"regraded {report['regraded']} of {report['diffs']} diffs into {report.get('into', '?')}: "
        f"{report['changed']} rewards changed, {report['repeated_diffs']} repeated diffs, "
        f"{len(report['problems'])} problems"
    ]
    for version, tally in report["policy_versions"].items():
        line = (
            f"policy {version}: {tally['regraded']} regraded, {tally['changed']} changed "
            f"({tally['lowered']} lowered, {tally['raised']} raised), "
            f"{tally['not_graded_before']} not graded before, {tally['reflagged']} reflagged"
        )
        if tally["flags"]:
            line += "; flags " + ", ".join(f"{name} {n}" for name, n in tally["flags"].items())
        if tally["failure_kinds"]:
            line += "; now " + ", ".join(f"{kind} {n}" for kind, n in tally["failure_kinds"].items())
        lines.append(line)
    for change in report["changes"]:
        was, now = change["was"], change["now"]
        before = "never graded" if was is None else f"{was['reward']:.1f}"
        attempt = f"{change['rollout_id']}/{change['attempt_id'] or '-'}"
        lines.append(
            f"changed {attempt} policy {change['policy_version']}: {before} -> {now['reward']:.1f} "
            f"{now['failure_kind'] or 'solved'} [{', '.join(now['flags'])}]"
        )
    lines += [f"problem {problem}" for problem in report["problems"]]
    return lines
