"""The low-watermark commit rule, exhaustively: whatever order work starts, ends, is redelivered and is
committed in, a commit never passes an unfinished offset, and it reaches everything read once all ended."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rollbus.kafka.watermark import OffsetTracker, low_watermark


@given(st.integers(0, 50), st.sets(st.integers(0, 60)))
def test_the_watermark_is_the_oldest_unfinished_offset_else_all_read(
    next_offset: int, unfinished: set[int]
) -> None:
    unfinished = {o for o in unfinished if o < next_offset}
    got = low_watermark(next_offset, unfinished)
    assert got == (min(unfinished) if unfinished else next_offset)
    assert all(o >= got for o in unfinished), "nothing unfinished lies below the commit"


def test_nothing_read_commits_nothing() -> None:
    assert low_watermark(None, ()) is None


# One step of a consumer's life on partitions "a" and "b": take the next message, end a running one,
# commit, or lose the partition (a rebalance: its progress restarts from what was committed).
step = st.one_of(
    st.tuples(st.just("take"), st.sampled_from("ab")),
    st.tuples(st.just("end"), st.sampled_from("ab"), st.integers(0, 20)),
    st.tuples(st.just("commit"), st.sampled_from("ab")),
    st.tuples(st.just("lose"), st.sampled_from("ab")),
)


@given(st.lists(step, max_size=60))
def test_commits_never_pass_unfinished_work_and_catch_up_once_all_ended(steps: list[tuple]) -> None:
    """A model consumer: the broker's committed offset per partition, what it delivers next, what runs."""
    tracker = OffsetTracker()
    broker = {"a": 0, "b": 0}  # committed offsets
    delivered = dict(broker)  # the next offset the consumer reads
    running: dict[str, set[int]] = {"a": set(), "b": set()}
    for action, partition, *rest in steps:
        if action == "take":
            offset = delivered[partition]
            delivered[partition] += 1
            assert not tracker.seen(partition, offset)
            tracker.start(partition, offset)
            running[partition].add(offset)
        elif action == "end" and running[partition]:
            offset = sorted(running[partition])[rest[0] % len(running[partition])]
            tracker.end(partition, offset)
            running[partition].discard(offset)
        elif action == "commit":
            commits = tracker.to_commit([partition])
            if partition in commits:
                offset = commits[partition]
                assert all(o >= offset for o in running[partition]), "a commit passed running work"
                broker[partition] = offset
                tracker.committed(commits)
            assert tracker.to_commit([partition]) == {}, "a commit is handed out once per advance"
        elif action == "lose":
            tracker.forget([partition])
            running[partition].clear()  # abandoned: redelivered from the committed offset
            delivered[partition] = broker[partition]
    for partition in "ab":
        for offset in sorted(running[partition]):
            tracker.end(partition, offset)
        commits = tracker.to_commit([partition])
        assert commits.get(partition, broker[partition]) == delivered[partition], "all ended: all committed"


# --- the tracker, as the sandbox runner uses it ---------------------------------------------------------


@given(st.permutations(list(range(12))), st.integers(0, 12))
def test_commit_never_passes_a_running_task(order: list[int], ended: int) -> None:
    """Tasks 0..11 started in order, some ended in any order: the commit is the oldest still running."""
    tracker = OffsetTracker()
    for offset in range(12):
        tracker.start("p", offset)
    done = set(order[:ended])
    for offset in order[:ended]:
        tracker.end("p", offset)
    running = set(range(12)) - done
    expected = min(running) if running else 12
    assert tracker.to_commit(["p"]) == {"p": expected}


def test_commit_once_per_advance_and_only_for_assigned_partitions() -> None:
    tracker = OffsetTracker()
    tracker.start("a", 5)
    tracker.start("b", 0)
    assert tracker.to_commit(["a"]) == {"a": 5}  # the running task itself is re-read after a crash
    tracker.committed({"a": 5})
    assert tracker.to_commit(["a"]) == {}
    tracker.end("a", 5)
    assert tracker.to_commit(["a"]) == {"a": 6}


def test_redelivered_offsets_are_recognised_until_forgotten() -> None:
    tracker = OffsetTracker()
    tracker.start("p", 3)
    tracker.end("p", 3)
    assert tracker.seen("p", 3) and tracker.seen("p", 0) and not tracker.seen("p", 4)
    tracker.forget({"p"})
    assert not tracker.seen("p", 3)
