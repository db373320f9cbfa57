"""Loss masks from turns: re-render merge mode, canonical chains, fan-out and reward split."""

from __future__ import annotations

import logging

import pytest

from rollbus.trajectory import (
    CONTEXT_VERSION,
    ChainBroken,
    FrozenChain,
    Turn,
    apply_loss_scope,
    common_prefix_length,
    fan_out,
    group_advantages,
    merge_turns,
    merge_turns_all,
    segment_chain,
)

SYSTEM = [1, 2, 3]


def turn(prompt: list[int], output: list[int], version: int = 7, logprobs: list[float] | None = None) -> Turn:
    if logprobs is None:
        logprobs = [-(t / 1000) for t in output]
    return Turn(prompt, output, logprobs, "stop", version)


def trained(seq) -> list[int]:
    return [t for t, m in zip(seq.response_ids, seq.loss_mask, strict=True) if m]


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length(list(range(1000)), list(range(999)) + [5]) == 999


def test_matched_prefixes_keep_every_output():
    o1, o2 = [100, 101], [200, 201, 202]
    t1 = turn(SYSTEM, o1, version=3)
    t2 = turn(SYSTEM + o1 + [50, 51], o2, version=4)
    seq = merge_turns([t1, t2])
    assert seq.prompt_ids == SYSTEM
    assert seq.response_ids == o1 + [50, 51] + o2
    assert seq.loss_mask == [1, 1, 0, 0, 1, 1, 1]
    assert seq.rollout_logprobs == [-0.1, -0.101, 0.0, 0.0, -0.2, -0.201, -0.202]
    assert seq.policy_versions == [3, 3, CONTEXT_VERSION, CONTEXT_VERSION, 4, 4, 4]
    assert seq.output_spans == [(0, 2), (4, 7)]


def test_middle_turn_skipped_by_next_prompt_is_dropped_cleanly():
    o1, o2, o3 = [100], [200, 201], [300]
    t1 = turn(SYSTEM, o1)
    t2 = turn(SYSTEM + o1 + [50], o2)
    t3 = turn(SYSTEM + o1 + [50] + [60], o3)  # o2 never made it into history
    seq = merge_turns([t1, t2, t3])
    assert seq.response_ids == o1 + [50, 60] + o3
    assert trained(seq) == o1 + o3
    assert 200 not in seq.response_ids


def test_drift_splitting_an_output_masks_its_kept_part():
    o1, o2 = [100, 101, 102, 103], [200]
    t1 = turn(SYSTEM, o1)
    t2 = turn(SYSTEM + [100, 101, 9, 103, 50], o2)  # re-render changed the third token
    seq = merge_turns([t1, t2])
    assert seq.response_ids == [100, 101, 9, 103, 50, 200]
    assert seq.loss_mask == [0, 0, 0, 0, 0, 1]
    assert seq.rollout_logprobs[:5] == [0.0] * 5
    assert seq.policy_versions[:2] == [7, 7]  # kept part is still a sampled token, only untrained
    assert seq.output_spans == [(5, 6)]


def test_drift_changing_token_count():
    o1, o2 = [100, 101, 102], [200]
    t1 = turn(SYSTEM, o1)
    t2 = turn(SYSTEM + [100, 8, 8, 8, 8, 102, 50], o2)
    seq = merge_turns([t1, t2])
    assert seq.response_ids == [100, 8, 8, 8, 8, 102, 50, 200]
    assert trained(seq) == o2
    assert seq.prompt_ids + seq.response_ids == t2.prompt_ids + o2


def test_consecutive_drifts():
    o1, o2, o3 = [100, 101], [200, 201], [300]
    t1 = turn(SYSTEM, o1)
    t2 = turn(SYSTEM + [100, 7, 50], o2)  # drifts o1
    t3 = turn(SYSTEM + [100, 7, 50, 200, 6, 51], o3)  # keeps o1's drift, drifts o2
    seq = merge_turns([t1, t2, t3])
    assert seq.response_ids == [100, 7, 50, 200, 6, 51, 300]
    assert seq.loss_mask == [0, 0, 0, 0, 0, 0, 1]


def test_cut_exactly_at_output_start_drops_it_without_masking_earlier_ones():
    o1, o2 = [100, 101], [200, 201]
    t1 = turn(SYSTEM, o1)
    t2 = turn(SYSTEM + o1 + [50], o2)
    t3 = turn(SYSTEM + o1 + [50, 77, 78], [300])
    seq = merge_turns([t1, t2, t3])
    assert trained(seq) == o1 + [300]
    assert seq.output_spans == [(0, 2), (5, 6)]


def test_prompt_base_restart_emits_each_base():
    t1 = turn(SYSTEM, [100])
    t2 = turn(SYSTEM + [100, 50], [200])
    t3 = turn([4, 5], [300])  # compaction: a new system/first user message
    t4 = turn([4, 5, 300, 51], [400])
    first, second = merge_turns_all([t1, t2, t3, t4])
    assert (first.prompt_ids, trained(first)) == (SYSTEM, [100, 200])
    assert (second.prompt_ids, trained(second)) == ([4, 5], [300, 400])
    assert merge_turns([t1, t2, t3, t4]).response_ids == second.response_ids


def test_empty_outputs_and_empty_segments():
    assert merge_turns([]) is None
    assert merge_turns([turn(SYSTEM, [])]) is None
    t1 = turn(SYSTEM, [])
    t2 = turn(SYSTEM + [50], [200])
    seq = merge_turns([t1, t2])
    assert seq.response_ids == [50, 200] and seq.output_spans == [(1, 2)]
    # a base whose only output is empty is dropped; the next base still counts
    assert [s.prompt_ids for s in merge_turns_all([t1, turn([9], [300])])] == [[9]]


def test_a_base_left_without_trained_tokens_is_dropped():
    t1 = turn(SYSTEM, [100, 101])
    t2 = turn(SYSTEM + [100, 9, 50], [])  # drift masks o1, and the turn sampled nothing
    assert merge_turns_all([t1, t2]) == []


def test_nothing_is_dropped_for_length():
    long_output = list(range(1000, 60_000))
    seq = merge_turns([turn(SYSTEM, long_output, logprobs=[-0.5] * len(long_output))])
    assert sum(seq.loss_mask) == len(long_output)


def test_logprob_length_mismatch_is_not_trained_and_is_counted(caplog):
    """A logprob of 0.0 would claim probability 1 and skew the importance ratio: mask 0 instead."""
    t1 = Turn(SYSTEM, [100, 101], [-0.3], "stop", 1, chain_id="main", turn_index=0)
    t2 = turn(SYSTEM + [100, 101, 50], [200])
    with caplog.at_level(logging.WARNING, logger="rollbus.trajectory"):
        seq = merge_turns([t1, t2])
        canonical = segment_chain([t1, t2])
    for tokens in (seq, canonical):
        assert tokens.loss_mask == [0, 0, 0, 1]
        assert tokens.rollout_logprobs == [0.0, 0.0, 0.0, -0.2]
        assert tokens.misaligned_tokens == 2
    assert merge_turns([t1]) is None  # nothing left to train
    assert "1 logprobs for 2 output tokens" in caplog.text
    [segment] = fan_out([FrozenChain("final", [t1, t2], "rerender", "main")], "r", 1.0)
    assert segment.misaligned_tokens == 2


def test_last_turn_loss_scope():
    t1 = turn(SYSTEM, [100, 101])
    t2 = turn(SYSTEM + [100, 101, 50], [200])
    seq = merge_turns([t1, t2], loss_scope="last_turn")
    assert seq.loss_mask == [0, 0, 0, 1]
    assert seq.rollout_logprobs == [0.0, 0.0, 0.0, -0.2]
    everything = merge_turns([t1, t2])
    assert apply_loss_scope(everything, "all_turns") is everything
    with pytest.raises(ValueError, match="loss scope"):
        apply_loss_scope(everything, "some_turns")


def test_segment_chain_on_canonical_chain():
    t1 = turn(SYSTEM, [100, 101], version=1)
    t2 = turn(SYSTEM + [100, 101, 60, 50], [200], version=2)
    tokens = segment_chain([t1, t2])
    assert tokens.response_ids == [100, 101, 60, 50, 200]
    assert tokens.loss_mask == [1, 1, 0, 0, 1]
    assert tokens.policy_versions == [1, 1, -1, -1, 2]


def test_segment_chain_refuses_a_prompt_that_rewrites_the_stream():
    t1 = turn(SYSTEM, [100, 101])
    t2 = turn(SYSTEM + [100, 9, 50], [200])
    with pytest.raises(ChainBroken):
        segment_chain([t1, t2])
    with pytest.raises(ValueError):
        segment_chain([])


def chain(kind: str, base: int, outputs: int) -> FrozenChain:
    turns, stream = [], [base]
    for i in range(outputs):
        out = [base * 100 + i]
        turns.append(turn(list(stream), out))
        stream += out + [5]
    return FrozenChain(kind, turns, chain_id=f"c{base}")


def test_fan_out_splits_reward_in_freeze_order():
    chains = [chain("subagent", 1, 2), chain("wipe", 2, 1), FrozenChain("subagent", []), chain("final", 3, 3)]
    segments = fan_out(chains, "r1", 0.9)
    assert [s.kind for s in segments] == ["subagent", "wipe", "final"]
    assert [s.index for s in segments] == [0, 1, 2]
    assert {s.num_segments for s in segments} == {3}
    assert [s.chain_id for s in segments] == ["c1", "c2", "c3"]
    assert sum(s.reward for s in segments) == pytest.approx(0.9)
    assert {s.trajectory_reward for s in segments} == {0.9}
    assert {s.rollout_id for s in segments} == {"r1"}
    assert trained(segments[2]) == [300, 301, 302]
    last = fan_out(chains, "r1", 0.9, loss_scope="last_turn")
    assert trained(last[2]) == [302]


def test_fan_out_of_a_rerendered_chain_counts_each_base():
    turns = [turn(SYSTEM, [100]), turn([4], [200])]
    segments = fan_out([FrozenChain("final", turns, history_mode="rerender")], "r", 1.0)
    assert [s.prompt_ids for s in segments] == [SYSTEM, [4]]
    assert [s.reward for s in segments] == [0.5, 0.5]


def test_group_advantages_are_per_trajectory():
    rewards = {"a": 1.0, "b": 0.0, "c": 0.5}
    assert group_advantages(rewards) == pytest.approx({"a": 0.5, "b": -0.5, "c": 0.0})
    normed = group_advantages(rewards, normalize_std=True)
    std = (1 / 6) ** 0.5
    assert normed["a"] == pytest.approx(0.5 / std, rel=1e-4)
    assert group_advantages({}) == {}
    # fan-out does not enter the baseline: a trajectory of 5 segments counts once
    uneven = fan_out([chain("wipe", i, 1) for i in range(1, 6)], "a", 1.0)
    assert {s.trajectory_reward for s in uneven} == {rewards["a"]}
