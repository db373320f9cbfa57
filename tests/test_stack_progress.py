"""The demo's view of a run is a fold over the bus's events: counts follow the events, duplicates included."""

from __future__ import annotations

from typing import Any

from rollbus.events import EventRecord, event_class
from rollbus.services.stack.progress import Progress
from rollbus.services.stack.progress import fold as fold_events
from tests.event_samples import SAMPLES, segment, turn


def fold(events: list[tuple[str, dict[str, Any]]]) -> Progress:
    """The fold of ``events``, each written as its event type and the record a reader decodes."""
    return fold_events(typed(t, r) for t, r in events)


def typed(event_type: str, record: dict[str, Any]) -> EventRecord:
    return event_class(event_type).from_dict(record)


def test_a_run_folds_into_its_summary():
    events = [
        ("task", {**SAMPLES["task"], "rollout_id": "a"}),
        ("task", {**SAMPLES["task"], "rollout_id": "b"}),
        ("turn", turn(rollout_id="a", policy_version=0)),
        ("turn", turn(rollout_id="b", policy_version=0)),
        ("diff", {**SAMPLES["diff"], "rollout_id": "a"}),
        ("reward", {**SAMPLES["reward"], "rollout_id": "a", "solved": True, "failure_kind": None}),
        ("segment", {**segment(10), "segment_id": "a/x/0", "rollout_id": "a"}),
        ("segment", {**segment(10), "segment_id": "a/x/0", "rollout_id": "a"}),  # redelivered
        ("policy", {**SAMPLES["policy"], "version": 1}),
        ("turn", turn(rollout_id="b", policy_version=1)),
        ("diff", {**SAMPLES["diff"], "rollout_id": "b", "failure_kind": "timeout"}),
        ("reward", {**SAMPLES["reward"], "rollout_id": "b", "solved": False, "failure_kind": "timeout"}),
    ]
    progress = fold(events)
    summary = progress.summary(train_steps=1)
    assert summary == {
        "rollouts_submitted": 2, "rollouts_finished": 2, "rollouts_failed": 1, "solved": 1, "segments": 1,
        "train_steps": 1, "policy_version": 1, "tokens_trained": 10, "duplicates_dropped": 1,
        "infrastructure_failures": 0, "infrastructure_failure_causes": {}, "reruns": 0, "refills": 0,
        "refill_reasons": {},
    }  # fmt: skip
    assert progress.running == set()
    assert progress.turn_policy_versions == [0, 0, 1]
    assert "turns served by v1" in progress.line()


def test_a_rollout_with_turns_and_no_diff_is_running():
    progress = fold([("task", SAMPLES["task"]), ("turn", turn())])
    assert progress.running == {"r-1"} and progress.finished == 0


def test_a_continued_run_counts_only_its_own_events_and_steps_from_the_earlier_policy():
    """The second demo of a run on the same topics: the first one's rollouts and steps are not its own."""
    progress = fold([])
    for event_type, record in [
        ("task", {**SAMPLES["task"], "rollout_id": "old"}),
        ("reward", {**SAMPLES["reward"], "rollout_id": "old"}),
        ("policy", {**SAMPLES["policy"], "version": 1}),
        ("policy", {**SAMPLES["policy"], "version": 2}),
    ]:
        progress.earlier(typed(event_type, record))
    assert progress.policy_base == progress.policy_version == 2 and progress.summary(train_steps=0)[
        "rollouts_submitted"] == 0  # fmt: skip
    progress.add(typed("task", {**SAMPLES["task"], "rollout_id": "new"}))
    progress.add(typed("policy", {**SAMPLES["policy"], "version": 2}))  # republished at a restart: no step
    progress.add(typed("policy", {**SAMPLES["policy"], "version": 3}))
    summary = progress.summary(train_steps=progress.policy_updates)
    assert (summary["rollouts_submitted"], summary["train_steps"], summary["policy_version"]) == (1, 1, 3)


def test_infrastructure_failures_and_their_reruns_are_counted_by_cause():
    """Injected boot failures: each is counted with its cause, its re-run by its own name; a policy failure
    (timeout) is a failure but not the infrastructure's."""
    infra = {"failure_kind": "rollout_failed", "failure_class": "infrastructure",
             "failure_cause": "boot_failed"}  # fmt: skip
    events = [
        ("task", {**SAMPLES["task"], "rollout_id": "g-0"}),
        ("task", {**SAMPLES["task"], "rollout_id": "g-1"}),
        ("reward", {**SAMPLES["reward"], "rollout_id": "g-0", **infra, "rerun_rollout_id": "g.r1-0"}),
        ("task", {**SAMPLES["task"], "rollout_id": "g.r1-0", "attempt": 1}),
        ("reward", {**SAMPLES["reward"], "rollout_id": "g-1", "failure_kind": "timeout",
                    "failure_class": "policy", "failure_cause": "timeout"}),
        ("reward", {**SAMPLES["reward"], "rollout_id": "g.r1-0"}),
    ]  # fmt: skip
    progress = fold(events)
    summary = progress.summary(train_steps=1)
    counted = ("infrastructure_failures", "infrastructure_failure_causes", "reruns")
    assert [summary[name] for name in counted] == [1, {"boot_failed": 1}, 1]
    assert summary["rollouts_submitted"] == summary["rollouts_finished"] == 3
    assert "1 by the infrastructure; 1 re-runs, 0 groups refilled" in progress.line()


def test_the_trainers_refills_are_counted_by_group_and_reason():
    """A refill group's samples count once as a group, by why the group it replaces did not train; a re-run
    of a refill's sample is a re-run, not another refill."""
    refill = {"group_id": "bug0-rf1", "refill_of": "z", "refill_reason": "zero_variance"}
    events = [
        ("task", {**SAMPLES["task"], **refill, "rollout_id": "bug0-rf1-0"}),
        ("task", {**SAMPLES["task"], **refill, "rollout_id": "bug0-rf1-1"}),
        ("task", {**SAMPLES["task"], **refill, "rollout_id": "bug0-rf1.r1-1", "attempt": 1}),
        ("task", {**SAMPLES["task"], "group_id": "bug1-rf2", "rollout_id": "bug1-rf2-0", "refill_of": "y",
                  "refill_reason": "infrastructure"}),
    ]  # fmt: skip
    summary = fold(events).summary(train_steps=0)
    assert (summary["refills"], summary["refill_reasons"], summary["reruns"]) == (
        2, {"infrastructure": 1, "zero_variance": 1}, 1
    )
