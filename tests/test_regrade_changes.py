"""The regrade's ledger (services/grader/changes.py): which rewards changed, under which policy version."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from rollbus.events import DiffEvent, RewardEvent, TurnEvent
from rollbus.services.grader.changes import UNKNOWN, Ledger, report_lines
from tests.event_samples import turn as sample_turn


def reward(
    rollout: str, value: float, attempt: str = "a-1", flags: tuple[str, ...] = (), kind: Any = None
) -> RewardEvent:
    return RewardEvent(
        rollout_id=rollout, attempt_id=attempt, reward=value, solved=value == 1.0, applied_cleanly=True,
        details="{}", failure_kind=kind, flags=list(flags), at=0,
    )  # fmt: skip


def diff(rollout: str, attempt: str = "a-1") -> DiffEvent:
    return DiffEvent(
        rollout_id=rollout, attempt_id=attempt, patch=b"", exit_status=0, wall_time_s=1.0, turns=1, at=0
    )


def turn(rollout: str, version: int, attempt: str = "a-1") -> TurnEvent:
    return TurnEvent.from_dict(sample_turn(rollout_id=rollout, attempt_id=attempt, policy_version=version))


def test_an_attempt_counts_under_the_latest_version_of_its_turns_or_unknown() -> None:
    ledger = Ledger()
    for record in [turn("r", 3), turn("r", 5), turn("r", 4), turn("r", 1, attempt="a-2")]:
        ledger.turn(record)
    for record in [reward("r", 1.0), reward("r", 1.0, attempt="a-2"), reward("s", 1.0)]:
        ledger.regraded(record)
    assert {v: t["regraded"] for v, t in ledger.report()["policy_versions"].items()} == {
        "1": 1,
        "5": 1,
        UNKNOWN: 1,
    }


def test_lowered_raised_reflagged_and_never_graded_are_told_apart() -> None:
    ledger = Ledger()
    for name in ("down", "up", "same", "reflag"):
        ledger.turn(turn(name, 7))
    ledger.reward_published(reward("down", 1.0))
    ledger.reward_published(reward("up", 0.0, flags=("touches_tests",), kind="flagged"))
    ledger.reward_published(reward("same", 0.0, kind="tests_failed"))
    ledger.reward_published(reward("reflag", 0.0, kind="tests_failed"))
    ledger.regraded(reward("down", 0.0, flags=("touches_conftest", "site_hooks"), kind="flagged"))
    ledger.regraded(reward("up", 1.0))
    ledger.regraded(reward("same", 0.0, kind="tests_failed"))
    ledger.regraded(reward("reflag", 0.0, flags=("exit_tricks",), kind="report_mismatch"))
    ledger.regraded(reward("new", 1.0))
    report = ledger.report()
    assert report["policy_versions"]["7"] == {
        "regraded": 4, "changed": 2, "lowered": 1, "raised": 1, "not_graded_before": 0, "reflagged": 1,
        "flags": {"site_hooks": 1, "touches_conftest": 1}, "failure_kinds": {"flagged": 1, "solved": 1},
    }  # fmt: skip
    assert report["policy_versions"][UNKNOWN]["not_graded_before"] == 1
    assert [(c["rollout_id"], c["was"] and c["was"]["reward"]) for c in report["changes"]] == [
        ("down", 1.0), ("up", 0.0), ("new", None),
    ]  # fmt: skip
    assert (report["regraded"], report["changed"]) == (5, 2)


def test_a_redelivered_reward_replaces_the_earlier_and_a_redelivered_diff_is_graded_once() -> None:
    ledger = Ledger()
    ledger.reward_published(reward("r", 0.0))
    ledger.reward_published(reward("r", 1.0))
    assert ledger.first_time(diff("r")) and not ledger.first_time(diff("r"))
    assert ledger.first_time(diff("r", attempt="a-2"))
    ledger.regraded(reward("r", 1.0))
    assert ledger.report()["changed"] == 0 and ledger.report()["repeated_diffs"] == 1


def test_report_lines_name_each_version_change_and_problem() -> None:
    ledger = Ledger()
    ledger.turn(turn("r", 2))
    ledger.reward_published(reward("r", 1.0))
    ledger.regraded(reward("r", 0.0, flags=("touches_conftest",), kind="flagged"))
    ledger.diffs = 2
    ledger.problem("diffs[1]@4", "undecodable diff, not regraded (bad magic)")
    lines = report_lines({"into": "t.regraded", **ledger.report()})
    assert lines == [
        "regraded 1 of 2 diffs into t.regraded: 1 rewards changed, 0 repeated diffs, 1 problems",
        "policy 2: 1 regraded, 1 changed (1 lowered, 0 raised), 0 not graded before, 0 reflagged; "
        "flags touches_conftest 1; now flagged 1",
        "changed r/a-1 policy 2: 1.0 -> 0.0 flagged [touches_conftest]",
        "problem diffs[1]@4: undecodable diff, not regraded (bad magic)",
    ]


attempts = st.lists(
    st.tuples(st.sampled_from("abcdef"), st.sampled_from([0.0, 1.0, None]), st.sampled_from([0.0, 1.0])),
    unique_by=lambda a: a[0],
)


@given(attempts, st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 3)))
def test_every_flip_is_listed_once_and_nothing_else(
    attempts: list[tuple[str, float | None, float]], versions: dict[str, int]
) -> None:
    ledger = Ledger()
    for name, version in versions.items():
        ledger.turn(turn(name, version))
    for name, was, _ in attempts:
        if was is not None:
            ledger.reward_published(reward(name, was))
    for name, _, now in attempts:
        ledger.regraded(reward(name, now))
    report = ledger.report()
    flips = {name for name, was, now in attempts if was is not None and was != now}
    listed = [c["rollout_id"] for c in report["changes"] if c["was"] is not None]
    assert sorted(listed) == sorted(flips)
    assert {c["rollout_id"] for c in report["changes"] if c["was"] is None} == {
        name for name, was, _ in attempts if was is None
    }
    for change in report["changes"]:
        assert change["policy_version"] == str(versions.get(change["rollout_id"], UNKNOWN))
    assert sum(t["changed"] for t in report["policy_versions"].values()) == len(flips) == report["changed"]
    assert report["regraded"] == len(attempts)
