"""Events of whole rollouts as the pipeline writes them, for the UI's tests and bench: the task, the adapter's
turns and sessions, the runner's diff, the grader's reward (tests/synthetic_rollouts.py) and the segments the
segmenter's own fan-out cuts from them; one drifted output where asked, as a re-rendered history leaves it."""

from __future__ import annotations

import json
from typing import Any

from rollbus.events import EVENTS
from rollbus.services.ui.model import Entry
from rollbus.trajectory import fan_out
from tests.synthetic_rollouts import Event, simple_rollout

AT = 1_700_000_000_000


def task(rollout_id: str, group: str, sample: int) -> dict[str, Any]:
    metadata = {"problem_statement": f"Make {rollout_id}'s failing test pass", "eval_cmd": "pytest -x"}
    return {
        "rollout_id": rollout_id, "group_id": group, "sample_index": sample, "group_size": 2,
        "prompt": "Fix the failing test", "label": "--- a/x.py\n+++ b/x.py\n",
        "metadata": json.dumps(metadata),
        "submitted_at": AT, "env_config": None, "ctx_config": None, "messages": None,
    }  # fmt: skip


def segments(writer: Any, reward: float, drift: bool, cut_at: int = AT + 1000) -> list[dict[str, Any]]:
    """The segments of ``writer``'s rollout, as the segmenter's fan-out cuts them (record fields as
    rollbus.services.segmenter.segmentation.segment_record writes them); with ``drift``, the last segment's
    last sampled output keeps its tokens and versions but loses its mask, as a drifted re-rendering does."""
    records = []
    for s in fan_out(writer.expected_chains(), writer.rollout_id, reward):
        mask = list(s.loss_mask)
        records.append({
            "segment_id": f"{writer.rollout_id}/{writer.attempt_id}/{s.index}",
            "rollout_id": writer.rollout_id,
            "group_id": writer.group_id, "index": s.index, "num_segments": s.num_segments, "kind": s.kind,
            "prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids), "loss_mask": mask,
            "rollout_logprobs": list(s.rollout_logprobs), "reward": s.reward,
            "trajectory_reward": s.trajectory_reward, "policy_versions": list(s.policy_versions),
            "created_at": cut_at, "attempt_id": writer.attempt_id, "chain_id": s.chain_id or "",
            "infos": "[]",
        })  # fmt: skip
    if drift:
        last = records[-1]
        sampled = [i for i, m in enumerate(last["loss_mask"]) if m]
        for i in sampled[-2:]:
            last["loss_mask"][i] = 0
    for record in records:
        record["loss_mask"] = bytes(record["loss_mask"])
    return records


def rollout_events(
    rollout_id: str, *, group: str = "g1", sample: int = 0, reward: float = 1.0, version: int = 0,
    drift: bool = False, cut_at: int = AT + 1000,
) -> list[Event]:  # fmt: skip
    writer = simple_rollout(rollout_id, reward=reward, group=group, policy_version=version)
    clock = AT
    for topic, record in writer.events:  # the adapter's clock: each call queued, generated, then tool time
        if topic == "turns":
            record["timings"] = {"started_at": clock, "finished_at": clock + 900, "generation_ms": 800}
            clock += 900 + 1500
    return [("tasks", task(rollout_id, group, sample)), *writer.events,
            *(("segments", s) for s in segments(writer, reward, drift, cut_at))]  # fmt: skip


def policy(version: int, at: int) -> Event:
    return ("policy", {"version": version, "location": f"/ckpt/v{version}", "published_at": at})


def train_step(step: int, group_ids: list[str], segments: list[dict[str, Any]], at: int) -> Event:
    """The trainer's fact of one step (figures made up, ids those of ``segments``)."""
    trained = sum(sum(s["loss_mask"]) for s in segments)
    response = sum(len(s["response_ids"]) for s in segments)
    return ("train-steps", {
        "step": step, "version": step, "group_ids": group_ids,
        "segment_ids": [s["segment_id"] for s in segments],
        "rollouts": len({s["rollout_id"] for s in segments}), "tokens_trained": trained,
        "response_tokens": response, "masked_fraction": trained / response, "reward_mean": 0.5,
        "solve_rate": 0.5, "loss": -0.03125, "grad_norm": 0.5, "clip_fraction": 0.0, "entropy": 1.5,
        "approx_kl": 0.00125, "logprob_diff_mean": 0.0625, "logprob_diff_max": 0.4375,
        "ratio_outside_fraction": 0.015625, "replayed_fraction": 0.0, "routing_agreement": None,
        "staleness_mean": 0.25, "staleness_min": 0, "staleness_max": 1, "wait_s": 1.5, "step_s": 2.5,
        "trained_at": at,
    })  # fmt: skip


def run_events() -> list[Event]:
    """Two groups of two: one solved and one failed each, the second round sampled by policy v1; one drift.
    Step 1 trained the first group (its fact, then policy v1); no step has trained the second yet."""
    events: list[Event] = [policy(0, AT - 10)]
    events += rollout_events("r-0", group="g0", sample=0, reward=1.0, version=0, drift=True)
    events += rollout_events("r-1", group="g0", sample=1, reward=0.0, version=0)
    events.append(train_step(1, ["g0"], [r for t, r in events if t == "segments"], AT + 1990))
    events.append(policy(1, AT + 2000))
    events += rollout_events("r-2", group="g1", sample=0, reward=1.0, version=1, cut_at=AT + 3000)
    events += rollout_events("r-3", group="g1", sample=1, reward=0.0, version=1, cut_at=AT + 3000)
    return events


EVENT_OF = {spec.topic: spec.event_type for spec in EVENTS}
PARTITIONS = 3


def entries(events: list[tuple[str, dict]]) -> list[Entry]:
    """Each event placed as the bus would: a partition per key, offsets counting up per partition."""
    offsets: dict[tuple[str, int], int] = {}
    out = []
    for topic, record in events:
        key = record.get("rollout_id")
        partition = sum(map(ord, key)) % PARTITIONS if key and topic != "policy" else 0
        offset = offsets[(topic, partition)] = offsets.get((topic, partition), -1) + 1
        out.append(Entry(topic, partition, offset, AT, key, EVENT_OF[topic], record))
    return out
