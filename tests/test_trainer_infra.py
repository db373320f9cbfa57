"""Infrastructure failures never train and never move a baseline: from the reward the grader writes, through
the segmenter's state machine (one marker segment, on the wire), to the trainer's group buffer and batch."""

from __future__ import annotations

import pytest

from rollbus import codec
from rollbus.events import TaskEvent
from rollbus.services.segmenter.segmentation import Segmenter
from rollbus.services.segmenter.segmentation.state import Fact
from rollbus.trainer.batch import (
    Admission,
    GroupBuffer,
    InvalidSegment,
    sample_lineage,
    segment_inputs,
    too_few_valid,
    validate,
)
from tests.test_trainer_batch import segment

AT = 1_700_000_000_000


def reward(rollout: str, group: str = "g", *, cause: str = "boot_failed", rerun: str | None = None) -> dict:
    """What the grader publishes for a rollout the runner failed with ``cause`` (core.reward_record's)."""
    from rollbus.failures import failure_class

    return {
        "rollout_id": rollout, "reward": 0.0, "solved": False, "applied_cleanly": False, "details": "{}",
        "failure_kind": "rollout_failed", "at": AT, "attempt_id": f"{rollout}-att", "group_id": group,
        "group_size": 4, "flags": [], "tests": [], "step_rewards": [], "infos": "[]",
        "failure_class": failure_class(cause), "failure_cause": cause, "rerun_rollout_id": rerun,
    }  # fmt: skip


def marker(rollout: str, group: str = "g", *, rerun: str | None = None) -> dict:
    """The segment the real segmenter cuts from an infrastructure-failed reward, through the codec."""
    segmenter = Segmenter({}, {})
    outcome = segmenter.handle(Fact("reward", reward(rollout, group, rerun=rerun), AT), b"")
    (message,) = outcome.messages
    return codec.decode(message).record


def test_an_infrastructure_failure_is_cut_at_once_into_one_marker_without_tokens() -> None:
    """No session closed, no turn seen (the sandbox never booted): the marker does not wait for them."""
    seg = marker("r3", rerun="r3.r1")
    assert (seg["failure_class"], seg["failure_cause"], seg["rerun_rollout_id"]) == (
        "infrastructure", "boot_failed", "r3.r1"
    )
    assert (seg["num_segments"], seg["prompt_ids"], seg["response_ids"], seg["loss_mask"]) == (1, [], [], b"")
    validate(seg, vocab_size=100)


def test_nemo_rl_3467_rewards_1_0_0_infra_give_centred_advantages_and_infra_trains_nothing() -> None:
    """rewards [1, 0, 0, infra]: advantages [0.667, -0.333, -0.333] for the three valid samples, mean-centred
    over them alone; the infrastructure sample has no input, and the reducer weighs 3 rollouts, not 4."""
    buffer = GroupBuffer(group_size=4)
    samples = [segment("g", f"r{i}", reward=r) for i, r in enumerate([1.0, 0.0, 0.0])] + [marker("r3")]
    outcomes = [buffer.add(s) for s in samples]
    assert outcomes == [Admission.BUFFERED] * 3 + [Admission.GROUP_COMPLETE]
    (group,) = buffer.take(1)
    assert group.rewards() == {"r0": 1.0, "r1": 0.0, "r2": 0.0} and group.infrastructure_failed() == ["r3"]
    inputs = segment_inputs([group], normalize_std=False)
    assert [round(x.advantage, 3) for x in inputs] == [0.667, -0.333, -0.333]
    assert [x.weight for x in inputs] == pytest.approx([1 / (2 * 3)] * 3)  # 2 masked tokens, 3 rollouts


def test_with_std_normalisation_the_std_is_of_the_valid_samples_only() -> None:
    buffer = GroupBuffer(group_size=4)
    for s in [segment("g", f"r{i}", reward=r) for i, r in enumerate([1.0, 0.0, 0.0])] + [marker("r3")]:
        buffer.add(s)
    inputs = segment_inputs(buffer.take(1), normalize_std=True)
    std = (((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 3) ** 0.5  # of [1, 0, 0]; with the infra 0 it would differ
    expected = [(2 / 3) / std, -(1 / 3) / std, -(1 / 3) / std]
    assert [x.advantage for x in inputs] == pytest.approx(expected, 1e-5)


def test_a_rerun_takes_the_place_of_the_failed_sample_and_the_group_waits_for_it() -> None:
    buffer = GroupBuffer(group_size=2)
    assert buffer.add(segment("g", "r0", reward=1.0)) is Admission.BUFFERED
    assert buffer.add(marker("r1", rerun="r1.r1")) is Admission.BUFFERED  # its re-run is coming
    assert buffer.add(marker("r1.r1", rerun="r1.r2")) is Admission.BUFFERED  # failed again, re-run again
    assert buffer.add(segment("g", "r1.r2", reward=0.0)) is Admission.GROUP_COMPLETE
    (group,) = buffer.take(1)
    assert group.rewards() == {"r0": 1.0, "r1.r2": 0.0}
    assert [round(x.advantage, 3) for x in segment_inputs([group], normalize_std=False)] == [0.5, -0.5]


def test_a_rerun_arriving_before_the_failed_samples_marker_completes_the_group_the_marker_is_late() -> None:
    buffer = GroupBuffer(group_size=2)
    buffer.add(segment("g", "r0", reward=1.0))
    assert buffer.add(segment("g", "r1.r1", reward=0.0)) is Admission.GROUP_COMPLETE
    assert buffer.add(marker("r1", rerun="r1.r1")) is Admission.LATE


def test_a_sample_failed_past_its_retry_budget_ends_and_the_group_trains_on_the_rest() -> None:
    buffer = GroupBuffer(group_size=3)
    buffer.add(segment("g", "r0", reward=1.0))
    buffer.add(segment("g", "r1", reward=0.0))
    assert buffer.add(marker("r2.r2")) is Admission.GROUP_COMPLETE  # no rerun: the budget is spent
    (group,) = buffer.take(1)
    assert too_few_valid(group, minimum=2, group_size=3) is None
    assert [round(x.advantage, 3) for x in segment_inputs([group], normalize_std=False)] == [0.5, -0.5]


def test_a_group_left_with_too_few_valid_samples_is_dropped_with_its_reason() -> None:
    buffer = GroupBuffer(group_size=3)
    for s in [segment("g", "r0", reward=1.0), marker("r1"), marker("r2")]:
        buffer.add(s)
    (group,) = buffer.take(1)
    assert too_few_valid(group, minimum=2, group_size=3) == (
        "1 valid sample(s) of 3 after 2 infrastructure failure(s) (minimum 2)"
    )
    assert too_few_valid(group, minimum=1, group_size=3) is None


def test_only_a_rerun_admits_a_rollout_beyond_the_groups_size() -> None:
    buffer = GroupBuffer(group_size=2)
    buffer.add(segment("g", "r0", k=2))
    buffer.add(marker("r1"))  # ended for good: the group's two places are taken
    with pytest.raises(InvalidSegment, match="already has 2 rollouts"):
        buffer.add(segment("g", "r2"))


def test_a_marker_that_carries_tokens_is_refused() -> None:
    forged = {**marker("r3"), "prompt_ids": [1], "response_ids": [5], "loss_mask": b"\x01",
              "rollout_logprobs": [-0.1], "policy_versions": [1]}  # fmt: skip
    with pytest.raises(InvalidSegment, match="infrastructure marker has tokens"):
        validate(forged, vocab_size=100)


def test_a_policy_failure_trains_as_a_zero_in_the_groups_mean() -> None:
    """A policy-caused failure (here a timeout) is an ordinary sample: reward 0, its tokens train."""
    buffer = GroupBuffer(group_size=2)
    buffer.add(segment("g", "r0", reward=1.0))
    buffer.add(segment("g", "r1", reward=0.0, failure_class="policy", failure_cause="timeout"))
    (group,) = buffer.take(1)
    assert [round(x.advantage, 3) for x in segment_inputs([group], normalize_std=False)] == [0.5, -0.5]


def test_turns_of_an_infra_failed_rollout_arriving_after_its_marker_are_late_not_dead_letters() -> None:
    """An engine error mid-run: the adapter's turns may reach the segmenter after the reward (another topic).
    They never train, so arriving late changes nothing: counted, not dead-lettered."""
    from tests.synthetic_rollouts import RolloutWriter

    segmenter = Segmenter({}, {})
    failed = reward("r9", cause="session_failed")
    handled = segmenter.handle(Fact("reward", failed, AT), b"")
    segmenter.settle(handled)
    writer = RolloutWriter("r9", attempt_id=failed["attempt_id"])
    writer.turn("main", "main", [1, 2], 3)
    writer.close()
    for topic, record in writer.events:
        kind = {"turns": "turn", "sessions": "session"}[topic]
        raw = codec.encode(kind, record)
        late = segmenter.handle(Fact(kind, codec.decode(raw).record, AT), raw)
        assert late.admission == "late" and late.dead_letter is None and not late.messages


def test_an_over_sampled_group_trains_its_first_valid_samples_and_the_rest_arrive_late() -> None:
    """Groups of n + k (``--over-sample k``): the first n whole valid samples complete the group, a sample
    still arriving (one of its two segments in) is not trained, and what comes after is late."""
    buffer = GroupBuffer(group_size=2, over_sample=2)
    assert buffer.add(segment("g", "r0", 0, 2, reward=1.0)) is Admission.BUFFERED  # half of r0
    assert buffer.add(marker("r1")) is Admission.BUFFERED  # failed for good: a place of the k spares
    assert buffer.add(segment("g", "r2", reward=1.0)) is Admission.BUFFERED
    assert buffer.add(segment("g", "r3", reward=0.0)) is Admission.GROUP_COMPLETE
    (group,) = buffer.take(1)
    assert group.rewards() == {"r2": 1.0, "r3": 0.0}
    inputs = segment_inputs([group], normalize_std=False)
    assert [round(x.advantage, 3) for x in inputs] == [0.5, -0.5]
    assert [x.weight for x in inputs] == pytest.approx([1 / (2 * 2)] * 2)  # 2 rollouts, not the partial r0
    assert {s["segment_id"] for s in group.segments()} >= {"r0-0"}  # released with the group (offsets)
    assert buffer.add(segment("g", "r0", 1, 2, reward=1.0)) is Admission.LATE


def test_an_over_sampled_group_whose_samples_all_ended_trains_what_is_valid() -> None:
    buffer = GroupBuffer(group_size=2, over_sample=1)
    for s in [marker("r0"), segment("g", "r1", reward=1.0)]:
        assert buffer.add(s) is Admission.BUFFERED
    assert buffer.add(marker("r2")) is Admission.GROUP_COMPLETE  # all 3 ended, 1 valid
    (group,) = buffer.take(1)
    assert too_few_valid(group, minimum=2, group_size=2) is not None
    full = GroupBuffer(group_size=2, over_sample=1)
    for i in range(3):
        assert full.add(segment("h", f"r{i}", k=2)) is Admission.BUFFERED  # each still arriving
    with pytest.raises(InvalidSegment, match="already has 3 rollouts"):  # n + k, and no re-run was named
        full.add(segment("h", "r3"))


# --------------------------------------------------------------------------- the runner's crash window


def twin_ids() -> tuple[str, str]:
    """The first rollout of sample 1 and its re-run, named as the runner names them."""
    from rollbus.services.sandbox_runner.rerun import rerun_task

    task = TaskEvent(rollout_id="bug-g7-1", group_id="bug-g7", sample_index=1, group_size=2, prompt="p",
                     metadata="{}", submitted_at=0)  # fmt: skip
    rerun = rerun_task(task, "boot_failed", retries=2, now_ms=0)
    assert rerun is not None
    return task.rollout_id, rerun.rollout_id


@pytest.mark.parametrize("first", ["original", "rerun"])
def test_a_sample_run_twice_by_a_killed_runner_trains_once_the_first_to_arrive(first: str) -> None:
    """The window: a runner killed after publishing the re-run of a failed attempt and before its diff runs
    the task again; both the new attempt and the re-run succeed, so sample 1 has two valid rollouts and no
    marker. The first to arrive keeps the sample's place, the other is a twin: it never enters the group,
    its mean or its batch, and the group still waits for (and trains) its other sample."""
    original, rerun = twin_ids()
    assert sample_lineage(original) == sample_lineage(rerun) == "bug-g7-1" != sample_lineage("bug-g7-0")
    kept, twin = (original, rerun) if first == "original" else (rerun, original)
    buffer = GroupBuffer(group_size=2)
    assert buffer.add(segment("bug-g7", kept, reward=1.0)) is Admission.BUFFERED
    assert buffer.dropped(segment("bug-g7", twin, reward=1.0))  # its routed experts are not even fetched
    assert buffer.add(segment("bug-g7", twin, reward=1.0)) is Admission.TWIN
    assert buffer.add(segment("bug-g7", "bug-g7-0", reward=0.0)) is Admission.GROUP_COMPLETE
    (group,) = buffer.take(1)
    assert group.rewards() == {kept: 1.0, "bug-g7-0": 0.0}
    assert [round(x.advantage, 3) for x in segment_inputs([group], normalize_std=False)] == [-0.5, 0.5]
    assert buffer.add(segment("bug-g7", twin, reward=1.0)) is Admission.LATE


def test_a_rerun_after_its_samples_infrastructure_marker_is_not_a_twin() -> None:
    original, rerun = twin_ids()
    buffer = GroupBuffer(group_size=2)
    buffer.add(marker(original, "bug-g7", rerun=rerun))
    assert buffer.add(segment("bug-g7", rerun, reward=1.0)) is Admission.BUFFERED
    assert buffer.add(segment("bug-g7", "bug-g7-0", reward=0.0)) is Admission.GROUP_COMPLETE
