"""Advantages, group completion, validation, reducer weights: plain functions over plain data."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollbus.trainer.advantages import group_advantages, has_reward_variance, reward_std, segment_advantages
from rollbus.trainer.batch import (
    Admission,
    GroupBuffer,
    InvalidSegment,
    segment_inputs,
    split_for_ranks,
    staleness,
    validate,
)

rewards_st = st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=8)


def as_group(values: list[float]) -> dict[str, float]:
    return {f"r{i}": v for i, v in enumerate(values)}


@given(rewards_st)
def test_advantages_are_centred_and_scaled_within_the_group(values: list[float]) -> None:
    adv = group_advantages(as_group(values))
    assert math.fsum(adv.values()) == pytest.approx(0.0, abs=1e-6)
    if has_reward_variance(as_group(values)):
        spread = math.sqrt(math.fsum(a * a for a in adv.values()) / len(adv))
        assert spread <= 1.0 + 1e-9  # the eps only ever shrinks
        if reward_std(as_group(values)) > 1e-2:
            assert spread == pytest.approx(1.0, abs=1e-3)
        for i, a in enumerate(values):
            for j, b in enumerate(values):
                if a < b:
                    assert adv[f"r{i}"] <= adv[f"r{j}"]
    else:
        assert set(adv.values()) == {0.0}


@given(rewards_st)
def test_without_std_normalisation_advantages_are_reward_minus_mean(values: list[float]) -> None:
    adv = group_advantages(as_group(values), normalize_std=False)
    mean = sum(values) / len(values)
    for i, v in enumerate(values):
        expected = 0.0 if not has_reward_variance(as_group(values)) else v - mean
        assert adv[f"r{i}"] == pytest.approx(expected, abs=1e-9)


@given(rewards_st, st.lists(st.integers(1, 5), min_size=8, max_size=8))
def test_every_segment_gets_its_trajectorys_advantage_whatever_the_cut(values, cuts) -> None:
    """The number of segments a trajectory is cut into never changes its (or anyone's) advantage."""
    adv = group_advantages(as_group(values))
    owners = {f"r{i}-s{k}": f"r{i}" for i in range(len(values)) for k in range(cuts[i])}
    per_segment = segment_advantages(owners, adv)
    for segment, rollout in owners.items():
        assert per_segment[segment] == adv[rollout]


def segment(group="g", rollout="r0", index=0, k=1, reward=1.0, mask=b"\x01\x01", versions=(3, 3), **kw):
    n = len(mask)
    record = {
        "segment_id": f"{rollout}-{index}", "rollout_id": rollout, "group_id": group, "index": index,
        "num_segments": k, "prompt_ids": [1, 2], "response_ids": [5] * n, "loss_mask": mask,
        "rollout_logprobs": [-0.5] * n, "trajectory_reward": reward, "policy_versions": list(versions),
        "attempt_id": "", "reward": reward / k,
    }  # fmt: skip
    record.update(kw)
    return record


def group_segments(group: str, sizes: list[int]) -> list[dict]:
    return [
        segment(group, f"{group}-r{r}", i, k, reward=float(r)) for r, k in enumerate(sizes) for i in range(k)
    ]


@settings(max_examples=60)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_a_group_completes_exactly_at_its_last_segment_in_any_order(sizes, rnd) -> None:
    segments = group_segments("g", sizes)
    rnd.shuffle(segments)
    buffer = GroupBuffer(group_size=len(sizes))
    outcomes = [buffer.add(s) for s in segments]
    assert outcomes[-1] is Admission.GROUP_COMPLETE
    assert set(outcomes[:-1]) <= {Admission.BUFFERED}
    (group,) = buffer.take(1)
    assert len(group.segments()) == sum(sizes)
    assert [buffer.add(s) for s in segments] == [Admission.LATE] * len(segments)


def test_duplicates_are_counted_not_buffered_twice() -> None:
    buffer = GroupBuffer(group_size=2)
    first = segment(rollout="a", k=2)
    assert buffer.add(first) is Admission.BUFFERED
    assert buffer.add(dict(first)) is Admission.DUPLICATE
    assert len(buffer.buffered()) == 1


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"index": 1, "segment_id": "a-1", "num_segments": 3}, "num_segments differs"),
        ({"index": 1, "segment_id": "a-1", "attempt_id": "other"}, "attempt_id differs"),
        ({"index": 1, "segment_id": "a-1", "trajectory_reward": 9.0}, "trajectory_reward differs"),
        ({"segment_id": "forged"}, "index 0 already taken"),
    ],
)
def test_a_segment_contradicting_its_rollout_is_refused(change: dict, why: str) -> None:
    buffer = GroupBuffer(group_size=2)
    buffer.add(segment(rollout="a", k=2))
    with pytest.raises(InvalidSegment, match=why):
        buffer.add(segment(rollout="a", k=2) | change)


def test_a_group_cannot_grow_past_its_size() -> None:
    buffer = GroupBuffer(group_size=1)
    buffer.add(segment(rollout="a", k=2))
    with pytest.raises(InvalidSegment, match="already has 1 rollouts"):
        buffer.add(segment(rollout="b"))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"loss_mask": b"\x01"}, "disagree in length"),
        ({"loss_mask": b"\x01\x02"}, "0 or 1"),
        ({"index": 1}, "index outside"),
        ({"index": -1}, "index outside"),
        ({"prompt_ids": []}, "empty prompt"),
        ({"response_ids": [5, 100]}, "outside the vocabulary"),
        ({"prompt_ids": [-1]}, "outside the vocabulary"),
        ({"rollout_logprobs": [float("nan"), -1.0]}, "not finite"),
        ({"rollout_logprobs": [0.5, -1.0]}, "above 0"),
        ({"trajectory_reward": float("inf")}, "trajectory_reward"),
    ],
)
def test_malformed_segments_are_refused_with_a_reason(change: dict, why: str) -> None:
    with pytest.raises(InvalidSegment, match=why):
        validate(segment(**change), vocab_size=100)


def test_unmasked_logprobs_are_not_checked() -> None:
    validate(segment(mask=b"\x01\x00", rollout_logprobs=[-1.0, float("nan")]), vocab_size=100)


def test_staleness_is_measured_from_the_oldest_trained_token() -> None:
    assert staleness(segment(mask=b"\x01\x01\x00", versions=(4, 2, 0)), current_version=5) == 3
    assert staleness(segment(mask=b"\x00\x00", versions=(0, 0)), current_version=5) == 0


def test_reducer_weights_count_each_rollout_once() -> None:
    """A rollout cut in 3 segments and one left whole weigh the same in the step (sum of weights x mask)."""
    buffer = GroupBuffer(group_size=2)
    for s in [segment("g", "a", i, 3, reward=1.0) for i in range(3)] + [segment("g", "b", 0, 1, reward=0.0)]:
        buffer.add(s)
    inputs = segment_inputs(buffer.take(1), normalize_std=True)
    assert len(inputs) == 4
    per_rollout = [sum(float(x.weight) * len(x.positions) for x in inputs[:3]), inputs[3].weight * 2]
    assert per_rollout == pytest.approx([0.5, 0.5])
    assert [x.advantage for x in inputs[:3]] == [inputs[0].advantage] * 3
    assert inputs[0].advantage == pytest.approx(1.0, abs=1e-5) and inputs[3].advantage == pytest.approx(
        -1.0, abs=1e-5
    )


@given(st.lists(st.integers(1, 50), max_size=20), st.integers(1, 4))
def test_rank_shares_partition_the_batch(lengths: list[int], world: int) -> None:
    class Fake:
        def __init__(self, n: int) -> None:
            self.input_ids = [0] * n

    inputs = [Fake(n) for n in lengths]
    shares = split_for_ranks(inputs, world)
    assert len(shares) == world
    assert sorted(id(x) for s in shares for x in s) == sorted(id(x) for x in inputs)


def test_an_incomplete_group_is_abandoned_by_segment_time_and_its_stragglers_are_late() -> None:
    buffer = GroupBuffer(group_size=2)
    buffer.add(segment("g", "a", created_at=1_000))
    buffer.add(segment("h", "x", created_at=5_000))
    assert buffer.expire(now_ms=5_000, timeout_ms=4_000) == []
    (gone,) = buffer.expire(now_ms=5_001, timeout_ms=4_000)
    assert gone.group_id == "g" and [g for g in buffer.pending] == ["h"]
    assert buffer.add(segment("g", "b", created_at=6_000)) is Admission.LATE


def test_abandoning_a_poisoned_group_makes_its_other_segments_late() -> None:
    buffer = GroupBuffer(group_size=2)
    buffer.add(segment("g", "a", 0, 2))
    gone = buffer.abandon("g")
    assert gone is not None and buffer.pending == {} and buffer.buffered() == []
    assert buffer.add(segment("g", "a", 1, 2)) is Admission.LATE
    assert buffer.abandon("never-seen") is None and buffer.add(segment("never-seen")) is Admission.LATE


def test_finished_groups_are_forgotten_after_the_horizon_in_segment_time_only() -> None:
    buffer = GroupBuffer(group_size=1)
    buffer.add(segment("g", "a", created_at=1_000))
    buffer.take(1)
    buffer.add(segment("h", "b", created_at=5_000))
    assert buffer.forget(horizon_ms=4_000) == 0  # g finished at 1 000, the clock is at 5 000: kept
    assert buffer.add(segment("g", "a2", created_at=5_000)) is Admission.LATE
    buffer.add(segment("i", "c", created_at=5_001))
    assert buffer.forget(horizon_ms=4_000) == 1 and "g" not in buffer.finished
    assert buffer.add(segment("g", "a3", created_at=5_002)) is Admission.GROUP_COMPLETE  # a new group now
    assert buffer.finished == {} and [g.group_id for g in buffer.complete] == ["h", "i", "g"]
