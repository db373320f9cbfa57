"""Table writes that reach the changelog once per key per commit: the segmenter's write-back cache.

Why: the segmenter rewrites a rollout's state on every event and writes, then deletes, every turn body. Sent
one by one (Faust's ``table[key] = value``), that was about three changelog messages per input message, most
of them superseded within the second. Kafka Streams' record cache answers the same problem the same way: the
local store is written at once, and before offsets are committed the changelog gets each key's latest value
(:func:`services.segmenter.app.commit_after_changelogs` flushes this buffer, waits for the acks, and only then
lets the commit go ahead). So a crash loses no committed event's state: uncommitted events are redelivered
and merged again (the state machine is idempotent), exactly as when a queued Faust write was lost. A key
written and deleted between two commits (a turn body of a rollout cut within the second) never reaches the
changelog at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_handled: ContextVar[int | None] = ContextVar("rollbus_segmenter_partition", default=None)


def current_partition() -> int:
    """The partition of the message being handled: a table change is logged where its event came from."""
    partition = _handled.get()
    if partition is None:
        raise RuntimeError("a segmenter table can only change while a message is handled")
    return partition


@contextmanager
def handling(partition: int) -> Iterator[None]:
    """Table changes made inside are logged to ``partition`` (the handled message's)."""
    token = _handled.set(partition)
    try:
        yield
    finally:
        _handled.reset(token)


class ChangelogBuffer(MutableMapping[str, bytes]):
    """A Faust table (``raw`` bytes values) read and written locally at once, logged at :meth:`flush`."""

    def __init__(self, table: Any, partition_of: Callable[[], int] = current_partition) -> None:
        self.table, self.partition_of = table, partition_of
        self._dirty: dict[str, tuple[int, bytes | None]] = {}  # key -> (partition, latest value or deleted)
        self._fresh: set[str] = set()  # dirty keys the changelog has never seen

    def __getitem__(self, key: str) -> bytes:
        return self.table.data[key]

    def __setitem__(self, key: str, value: bytes) -> None:
        partition = self.partition_of()  # first: a change that cannot be logged is not made
        if key not in self._dirty and key not in self.table.data:
            self._fresh.add(key)
        self.table.data[key] = value
        self._dirty[key] = (partition, value)

    def __delitem__(self, key: str) -> None:
        partition = self.partition_of()
        del self.table.data[key]
        if key in self._fresh:  # written and deleted since the last flush: nothing to log
            self._fresh.discard(key)
            self._dirty.pop(key, None)
        else:
            self._dirty[key] = (partition, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.table.data)

    def __len__(self) -> int:
        return len(self.table.data)

    def __contains__(self, key: object) -> bool:
        return key in self.table.data

    @property
    def pending(self) -> int:
        """Keys whose latest change is not in the changelog yet."""
        return len(self._dirty)

    def flush(self) -> None:
        """Hand every key's latest change to the producer (``send_changelog``, whose futures the commit waits
        for); a deleted key becomes a tombstone, as Faust's own ``del table[key]`` does."""
        dirty, self._dirty, self._fresh = self._dirty, {}, set()
        for key, (partition, value) in dirty.items():
            if value is None:
                self.table.send_changelog(partition, key, None, value_serializer="raw")
            else:
                self.table.send_changelog(partition, key, value)
