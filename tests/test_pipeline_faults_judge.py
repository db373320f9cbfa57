"""The fault test's judge (``tests/pipeline_faults.judge``) over plain data: each broken promise is named, so
the whole-pipeline test cannot pass by checking nothing."""

from __future__ import annotations

from typing import Any

from tests.pipeline_faults import judge, trainable_groups


def segment(rollout: str, attempt: str = "a1", index: int = 0, reward: float = 1.0, **extra: Any) -> dict:
    return {"segment_id": f"{rollout}/{attempt}/{index}", "rollout_id": rollout, "attempt_id": attempt,
            "group_id": rollout.rsplit("-", 1)[0], "index": index, "num_segments": 1,
            "trajectory_reward": reward, **extra}  # fmt: skip


def raw(records: list[dict]) -> list[tuple[bytes, dict]]:
    return [(repr(sorted(r.items())).encode(), r) for r in records]


def clean() -> dict[str, Any]:
    segments = [segment("g-0"), segment("g-1", reward=0.0)]
    return {
        "tasks": raw([{"rollout_id": "g-0"}, {"rollout_id": "g-1"}]),
        "rewards": raw([{"rollout_id": "g-0", "attempt_id": "a1", "reward": 1.0, "at": 1},
                        {"rollout_id": "g-1", "attempt_id": "a1", "reward": 0, "failure_kind": "x", "at": 2},
                        {"rollout_id": "g-0", "attempt_id": "a1", "reward": 1.0, "at": 9}]),  # a redelivery
        "segments": raw(segments + segments[:1]),  # a re-cut, byte-identical
        "rebuilt": raw(segments),
        "steps": [{"step": 1, "group_ids": ["g"]}],
    }  # fmt: skip


def test_a_clean_run_has_no_problems() -> None:
    verdict = judge(**clean())
    assert verdict.problems == [] and (verdict.rollouts, verdict.rewards, verdict.segments) == (2, 2, 2)
    assert verdict.groups_trained == 1


def test_a_group_must_train_once_all_its_segments_are_out_and_its_rewards_differ() -> None:
    def groups(*segments: dict) -> set[str]:
        return trainable_groups({s["segment_id"]: s for s in segments}, group_size=2)

    assert groups(segment("g-0"), segment("g-1", reward=0.0)) == {"g"}
    assert groups(segment("g-0"), segment("g-1")) == set()  # no variance: skipped, not owed
    assert groups(segment("g-0"), segment("g-1", reward=0.0, num_segments=2)) == set()  # one still to come
    assert groups(segment("g-0")) == set()  # the other rollout failed before any segment


def test_a_reward_graded_again_after_a_grader_crash_is_one_reward_not_two() -> None:
    """The grader published, crashed before committing and graded the same diff again: a new ``at`` and new
    durations in ``details``, the same verdict. That is one reward; a changed verdict is two."""
    run = clean()
    first = {"rollout_id": "g-0", "attempt_id": "a1", "reward": 1.0, "at": 1, "details": '{"eval_s": 1.5}'}
    run["rewards"] = raw([first, dict(first, at=9, details='{"eval_s": 2.25}'), run["rewards"][1][1]])
    verdict = judge(**run)
    assert verdict.problems == [] and verdict.rewards == 2
    run["rewards"].extend(raw([dict(first, at=12, reward=0.0)]))
    assert judge(**run).problems == ["rollout g-0: an attempt rewarded twice, differently"]


def test_each_broken_promise_is_named() -> None:
    cases = {
        "rewarded attempts": lambda run: run["rewards"].extend(raw([{"rollout_id": "g-1", "attempt_id": "a2",
                                                                      "reward": 1.0}])),
        "no reward": lambda run: run["tasks"].extend(raw([{"rollout_id": "g-2"}])),
        "two contents": lambda run: run["segments"].extend(raw([segment("g-0", reward=0.5)])),
        "segments of attempts": lambda run: run["segments"].extend(raw([segment("g-1", "a2", 1)])),
        "trained at steps": lambda run: run["steps"].append({"step": 2, "group_ids": ["g"]}),
        "a step repeated": lambda run: run["steps"].append({"step": 1, "group_ids": []}),
        "rebuild differs": lambda run: run["rebuilt"].pop(),
    }  # fmt: skip
    for name, breaks in cases.items():
        run = clean()
        breaks(run)
        problems = judge(**run).problems
        expected = "rewarded attempts []" if name == "no reward" else name
        assert any(expected in problem for problem in problems), (name, problems)
