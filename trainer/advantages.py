"""Group-relative advantages: one number per trajectory, shared by every segment cut from it.

A rollout's advantage is its trajectory reward normalised within its group (minus the group mean, divided by
the group's standard deviation unless that is disabled). It is computed per trajectory and then broadcast to
the trajectory's segments, never normalised across segments: a batch-wide normalisation over segments would
weight a trajectory by how many segments it was cut into (the peers' bug this module exists to avoid).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

STD_EPS = 1e-6  # keeps a near-constant group from exploding; a constant group gets zero advantages anyway


def reward_std(rewards: Mapping[str, float]) -> float:
    """Population standard deviation of a group's trajectory rewards."""
    values = list(rewards.values())
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def has_reward_variance(rewards: Mapping[str, float]) -> bool:
    """False for a group whose rollouts all scored the same: it carries no learning signal."""
    values = list(rewards.values())
    return any(v != values[0] for v in values)


def group_advantages(rewards: Mapping[str, float], *, normalize_std: bool = True) -> dict[str, float]:
    """Advantage of each rollout (rollout id -> trajectory reward) relative to its group."""
    if not rewards:
        return {}
    mean = sum(rewards.values()) / len(rewards)
    if not has_reward_variance(rewards):
        return dict.fromkeys(rewards, 0.0)
    scale = reward_std(rewards) + STD_EPS if normalize_std else 1.0
    return {rollout: (reward - mean) / scale for rollout, reward in rewards.items()}


def segment_advantages(
    segment_rollouts: Mapping[str, str], rollout_advantages: Mapping[str, float]
) -> dict[str, float]:
    """Broadcast: each segment (segment id -> rollout id) gets its trajectory's advantage unchanged."""
    return {segment: rollout_advantages[rollout] for segment, rollout in segment_rollouts.items()}
