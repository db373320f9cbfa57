"""Exact refill (DAPO-style dynamic sampling): a group the trainer finishes without training it is replaced by
a new group from the dataset, so the steps keep training their full batch of groups.

A group is *lost* when the trainer decides it will never train: no reward variance (skipped), too few valid
samples after its infrastructure failures, too stale, poisoned, or abandoned incomplete. For each lost group
the trainer submits one new group of the next dataset row (cycling through the rows) to ``tasks``; each of
its records names the lost group (``refill_of``), so ``tasks`` itself is the ledger of refills.

Idempotent by key: the replacement's group id is derived from the lost group's id alone, at most one group
replaces a group, and the ledger is read back from ``tasks`` at start. A trainer killed after publishing a
refill and before its checkpoint replays the same segments, loses the same group again and finds its
replacement on the bus: nothing is submitted twice. Killed before publishing it, the replay loses the group
again and submits it then: nothing is lost (the group is lost before the checkpoint that remembers it as
finished is written, and the refill is published before that). A refill is one transaction, so a kill
mid-publish leaves all of its samples or none.

A replacement of a replacement is one generation deeper; past ``max_depth`` generations a lost group is not
replaced (a row whose every group lacks variance must not be sampled forever).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollbus.rows import Row, RowKeys, read_dataset, tasks_for
from rollbus.task_formats.common import FormatError


def refill_token(lost_group_id: str) -> str:
    """The group part of the replacement's id: the same for the same lost group, from any trainer."""
    return "rf" + hashlib.sha256(lost_group_id.encode()).hexdigest()[:10]


@dataclass
class Refills:
    """The ledger of refills (replacement group -> the group it replaced) and what to submit next."""

    rows: Sequence[Row]
    samples: int  # per group: the trainer's group size plus its over-sampling
    max_depth: int = 3
    replaces: dict[str, str] = field(default_factory=dict)  # replacement group id -> the lost group's id
    replaced: set[str] = field(default_factory=set)  # the lost groups that have their replacement

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a refill needs a dataset with at least one row")

    def note(self, task: Mapping[str, Any]) -> None:
        """Learn a ``tasks`` record read back from the bus or just published (only refills are kept)."""
        lost = task.get("refill_of")
        if lost:
            self.replaces.setdefault(str(task["group_id"]), str(lost))
            self.replaced.add(str(lost))

    def depth(self, group_id: str) -> int:
        """Generations of replacement between ``group_id`` and a group submitted otherwise (0)."""
        depth = 0
        while group_id in self.replaces and depth <= len(self.replaces):
            group_id, depth = self.replaces[group_id], depth + 1
        return depth

    def plan(
        self, lost_group_id: str, now_ms: int, reason: str | None = None
    ) -> tuple[str, list[dict[str, Any]] | None]:
        """What to do for a lost group: ``("submit", tasks)``, ``("already", None)`` when its replacement
        is on the bus, or ``("too_deep", None)`` past ``max_depth``. Planning is not submitting: call
        :meth:`note` with the tasks once they are published. ``reason``: why the group was lost (recorded
        on the tasks as ``refill_reason``)."""
        if lost_group_id in self.replaced:
            return "already", None
        if self.depth(lost_group_id) >= self.max_depth:
            return "too_deep", None
        row = self.rows[len(self.replaces) % len(self.rows)]
        tasks = tasks_for(row, self.samples, now_ms, group=refill_token(lost_group_id))
        return "submit", [{**task, "refill_of": lost_group_id, "refill_reason": reason} for task in tasks]


class RefillError(ValueError):
    """The refill dataset cannot be used; the message says why (one line)."""


def load_refills(
    dataset: Path | None, samples: int, max_depth: int, keys: RowKeys | None = None
) -> Refills | None:
    """The refills of ``--refill-dataset`` (None when unset): its good rows, in order (bad rows are left
    out, as ``rollbus submit`` skips them). :class:`RefillError` when it is unreadable or has no good row."""
    if dataset is None:
        return None
    try:
        rows = [item for item in read_dataset(dataset, keys or RowKeys()) if isinstance(item, Row)]
    except (OSError, FormatError) as err:
        raise RefillError(f"--refill-dataset {dataset}: {err}") from None
    if not rows:
        raise RefillError(f"--refill-dataset {dataset}: no row could become a task (see `rollbus submit`)")
    return Refills(rows, samples, max_depth)
