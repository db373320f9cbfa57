"""What infrastructure failures cost: re-running the failed samples against dropping every group that had one.

Run: ``python bench/infra_failures.py [--quick] [--rate 0.05] [--group-size 8] [--batch 8] [--steps N]``. Each
sample's attempt fails as infrastructure (``boot_failed``) with probability ``--rate``, independently; the
runner's own decision (:func:`rollbus.services.sandbox_runner.rerun.rerun_task`, ``--infra-retries``) re-runs
it as a new rollout, and the trainer's own group buffer (:class:`rollbus.trainer.batch.GroupBuffer`, the
markers the segmenter cuts for the failures) decides when a group completes and what it trains. The
baseline, measured on the same draws, drops every group with a failed sample (what training a group only
when all its samples succeeded costs). Prints the share of all rollouts that were re-runs, the steps that
trained their full batch, and the ratio of rollouts spent per trained sample, re-runs over the baseline.
"""

from __future__ import annotations

import argparse
import random

from rollbus.events import TaskEvent
from rollbus.services.sandbox_runner.rerun import rerun_task
from rollbus.trainer.batch import Admission, GroupBuffer, segment_inputs, too_few_valid

MIN_VALID = 2


def one_segment(group: str, rollout: str) -> dict:
    return {"segment_id": f"{rollout}/a/0", "rollout_id": rollout, "group_id": group, "index": 0,
            "num_segments": 1, "attempt_id": "a"}  # fmt: skip


def sample_segment(group: str, rollout: str, reward: float) -> dict:
    return {
        **one_segment(group, rollout), "prompt_ids": [1, 2], "response_ids": [5, 6], "loss_mask": b"\x01\x01",
        "rollout_logprobs": [-0.5] * 2, "trajectory_reward": reward, "policy_versions": [0, 0],
        "reward": reward,
    }  # fmt: skip


def marker(group: str, rollout: str, rerun: str | None) -> dict:
    """The segmenter's marker of an infrastructure-failed rollout (``completion.infrastructure_marker``)."""
    return {
        **one_segment(group, rollout), "prompt_ids": [], "response_ids": [], "loss_mask": b"",
        "rollout_logprobs": [], "trajectory_reward": 0.0, "policy_versions": [], "reward": 0.0,
        "failure_class": "infrastructure", "failure_cause": "boot_failed", "rerun_rollout_id": rerun,
    }  # fmt: skip


def run(rate: float, group_size: int, batch: int, steps: int, retries: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    buffer = GroupBuffer(group_size)
    rollouts = reruns = failures = 0
    trained_samples = dropped_groups = full_steps = 0
    baseline_rollouts = baseline_trained = 0
    groups_done: list = []
    number = 0
    while len(groups_done) < steps * batch:
        group = f"g{number}"
        number += 1
        clean = True
        for index in range(group_size):
            task = TaskEvent(rollout_id=f"{group}-{index}", group_id=group, sample_index=index,
                             group_size=group_size, prompt="", metadata="{}", submitted_at=0)  # fmt: skip
            while True:
                rollouts += 1
                failed = rng.random() < rate
                if not failed:
                    buffer_add(buffer, sample_segment(group, task.rollout_id, float(rng.random() < 0.5)))
                    break
                failures += 1
                clean = False
                again = rerun_task(task, "boot_failed", retries, now_ms=0)
                buffer_add(buffer, marker(group, task.rollout_id, again and again.rollout_id))
                if again is None:
                    break
                reruns += 1
                task = again
        baseline_rollouts += group_size  # the baseline's first attempts are the same draws
        baseline_trained += group_size if clean else 0
        for done in buffer.take(len(buffer.complete)):
            if too_few_valid(done, MIN_VALID, group_size) is not None:
                dropped_groups += 1
                continue
            groups_done.append(done)
            trained_samples += len(done.valid())
    for start in range(0, steps * batch, batch):
        step = groups_done[start : start + batch]
        full_steps += len(step) == batch
        segment_inputs(step, normalize_std=True)  # what the trainer builds from them: it must not fail
    return {
        "rollouts": rollouts, "reruns": reruns, "failures": failures, "trained": trained_samples,
        "dropped_groups": dropped_groups, "full_steps": full_steps, "baseline_rollouts": baseline_rollouts,
        "baseline_trained": baseline_trained,
    }  # fmt: skip


def buffer_add(buffer: GroupBuffer, segment: dict) -> None:
    assert buffer.add(segment) in (Admission.BUFFERED, Admission.GROUP_COMPLETE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps (the test's smoke run)")
    parser.add_argument("--rate", type=float, default=0.05, help="probability an attempt fails (infra)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="groups per step")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--retries", type=int, default=2, help="the runner's --infra-retries")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = 10 if args.quick else args.steps
    f = run(args.rate, args.group_size, args.batch, steps, args.retries, args.seed)
    print(f"failure rate {args.rate:.3f}, groups of {args.group_size}, {args.batch} groups a step, "
          f"{steps} steps")
    print(f"re-runs: {f['reruns']} of {f['rollouts']} rollouts ({f['reruns'] / f['rollouts']:.2%}); "
          f"{f['failures']} failures, each counted; {f['dropped_groups']} groups dropped (under "
          f"{MIN_VALID} valid); steps with their full batch: {f['full_steps']} of {steps}")  # fmt: skip
    wasted = 1 - f["baseline_trained"] / f["baseline_rollouts"]
    print(f"baseline (drop every group with a failure): {wasted:.2%} of rollouts wasted")
    ours = f["rollouts"] / max(f["trained"], 1)
    theirs = f["baseline_rollouts"] / max(f["baseline_trained"], 1)
    print(f"rollouts per trained sample: re-runs {ours:.3f}, baseline {theirs:.3f}; "
          f"ratio {ours / theirs:.3f}")


if __name__ == "__main__":
    main()
