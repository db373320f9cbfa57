"""The low-watermark commit rule: which offset a consumer may commit while its work ends out of order.

A partition's offset is committed only up to its oldest message whose work is unfinished: a consumer killed
with work in flight leaves it uncommitted, so it is redelivered (at-least-once) and done again. Plain data,
no Kafka: a consumer loop feeds :class:`OffsetTracker` offsets and asks what to commit; the trainer, which
keeps its own positions, asks :func:`low_watermark` directly.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import overload


@overload
def low_watermark(next_offset: int, unfinished: Iterable[int]) -> int: ...
@overload
def low_watermark(next_offset: int | None, unfinished: Iterable[int]) -> int | None: ...
def low_watermark(next_offset: int | None, unfinished: Iterable[int]) -> int | None:
    """The offset safe to commit on one partition (Kafka's convention: the next one to read): the oldest
    unfinished offset, else one past everything read (``next_offset``); None if nothing was read."""
    return min(unfinished, default=next_offset)


@dataclass
class PartitionProgress:
    """Offsets of one partition: work started and not yet ended, and the next offset after everything seen."""

    running: set[int] = field(default_factory=set)
    next_offset: int | None = None  # one past the highest offset seen
    committed: int | None = None  # the last offset handed to the broker as committed

    def committable(self) -> int | None:
        """The offset to commit (Kafka's convention: the next one to read), or None if nothing is done."""
        return low_watermark(self.next_offset, self.running)


class OffsetTracker:
    """Started and ended work per partition; ``to_commit`` gives the commits that move forward."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, PartitionProgress] = {}

    def seen(self, partition: Hashable, offset: int) -> bool:
        """Whether ``offset`` was already taken (running, or ended but possibly uncommitted)."""
        progress = self._parts.get(partition)
        if progress is None or progress.next_offset is None:
            return False
        return offset < progress.next_offset

    def start(self, partition: Hashable, offset: int) -> None:
        progress = self._parts.setdefault(partition, PartitionProgress())
        progress.running.add(offset)
        progress.next_offset = max(progress.next_offset or 0, offset + 1)

    def end(self, partition: Hashable, offset: int) -> None:
        self._parts[partition].running.discard(offset)

    def running(self, partition: Hashable) -> set[int]:
        progress = self._parts.get(partition)
        return set(progress.running) if progress else set()

    def to_commit(self, partitions: Iterable[Hashable]) -> dict[Hashable, int]:
        """New commit offsets for ``partitions`` (those still assigned), marked as committed."""
        commits = {}
        for partition in partitions:
            progress = self._parts.get(partition)
            if progress is None:
                continue
            offset = progress.committable()
            if offset is not None and offset != progress.committed:
                commits[partition] = offset
        return commits

    def committed(self, commits: dict[Hashable, int]) -> None:
        for partition, offset in commits.items():
            self._parts[partition].committed = offset

    def partitions(self) -> set[Hashable]:
        return set(self._parts)

    def forget(self, partitions: Iterable[Hashable]) -> None:
        """Partitions this consumer lost: their progress restarts from the broker's committed offset."""
        for partition in partitions:
            self._parts.pop(partition, None)
