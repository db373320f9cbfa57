"""Gym episodes and coding-agent rollouts through one real segmenter into one real trainer step.

Real: Kafka (conftest), the scripted rollbus engine, the adapter's OpenAI route, the gym runner (run with
``--loss-scope last_turn``), the segmenter (a Faust worker started by ``rollbus segmenter``, its own
``--loss-scope`` left at ``all_turns``) and the trainer (a tiny random Qwen3). The coding side is synthetic:
its turns, sessions, diffs and rewards are published directly, written as the adapter, runner and grader
write them (``tests/synthetic_rollouts.py``: a sub-agent, a compaction, a side call), because running the
Claude Code CLI per sample would make this test minutes slower and ``tests/test_e2e_claude_code.py``
already covers that path. What this leaves out: the coding events' producers themselves.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from rollbus.trainer.learner import Learner
from rollbus.trainer.service import Trainer
from rollbus.trainer.settings import TrainerSettings
from rollbus.trajectory import fan_out
from rollbus.turn_log import resolve_turns
from tests.segmenter_support import SegmenterProcess, namespace_of, publish, read_all, unique_segments
from tests.synthetic_rollouts import RolloutWriter, simple_rollout
from tests.test_gym_e2e import (
    SCRIPT,  # noqa: F401  (the conftest engine_url replays it)
    events,
    rewards_for,
    stack,
    task,
)
from tests.test_trainer_service import TINY, weights

pytestmark = pytest.mark.kafka


def dated_now(writer: RolloutWriter) -> RolloutWriter:
    """Shift the synthetic events' times (2023) to now: the trainer abandons a group still incomplete
    ``--group-timeout`` after its first segment in segment time (the reward's ``at``), so a 2023 group
    would be dropped as soon as a live gym segment arrived between its segments."""
    shift = int(time.time() * 1000) - min(r["at"] for _, r in writer.events if "at" in r)
    for _, record in writer.events:
        if "at" in record:
            record["at"] += shift
    return writer


def replayed_infos(bootstrap: str, ns: str, rollout: str) -> list[dict]:
    """The episode's info dicts as docs/gym.md shows them: ``rollbus replay rewards --key R --full``."""
    done = subprocess.run(
        [sys.executable, "-m", "rollbus", "replay", "rewards", "--key", rollout, "--full",
         "--bootstrap-servers", bootstrap, "--namespace", ns],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.splitlines()
    infos = json.loads(json.loads(line)["event"]["record"]["infos"])
    assert len(infos) == 3 and infos[0]["question"] == "Solve for x: 9x + 2 = 20"  # reset, then 2 steps
    return infos


def trained(segment: dict) -> list[int]:
    return [t for t, m in zip(segment["response_ids"], segment["loss_mask"], strict=True) if m]


async def test_one_step_trains_gym_and_coding_segments_cut_by_the_real_segmenter(
    kafka_bootstrap,
    topics,
    engine_url,
    tmp_path: Path,
):
    ns = namespace_of(topics)
    tag = uuid.uuid4().hex[:6]
    retry, wrong = f"retry-{tag}", f"wrong-{tag}"  # math seed 11: 0.5 after a hint; seed 4: 0 after two
    coding = [
        dated_now(simple_rollout(f"code-{tag}-{i}", reward=r, group=f"g-code-{tag}", policy_version=0))
        for i, r in enumerate((1.0, 0.0))
    ]
    with SegmenterProcess(kafka_bootstrap, ns, tmp_path) as worker:
        await publish(kafka_bootstrap, topics, [e for w in coding for e in w.events])
        async with stack(kafka_bootstrap, ns, engine_url, loss_scope="last_turn") as (_, publisher, _):
            for rollout, seed in ((retry, 11), (wrong, 4)):
                row = task(rollout, {"name": "math", "seed": seed}, group_id=f"g-math-{tag}", group_size=2)
                await publisher.publish(topics["tasks"], row)
            rewards = await rewards_for(kafka_bootstrap, topics["rewards"], {retry, wrong})
        assert {r: rewards[r]["reward"] for r in (retry, wrong)} == {retry: 0.5, wrong: 0.0}
        assert replayed_infos(kafka_bootstrap, ns, retry) == json.loads(rewards[retry]["infos"])
        found = await read_all(kafka_bootstrap, topics["segments"], until=8, timeout=120, worker=worker)
    segments = unique_segments(found)
    by_rollout: dict[str, list[dict]] = {}
    for segment in sorted(segments.values(), key=lambda s: (s["rollout_id"], s["index"])):
        by_rollout.setdefault(segment["rollout_id"], []).append(segment)
    assert sorted(by_rollout) == sorted([*(w.rollout_id for w in coding), retry, wrong]), worker.log()[-3000:]

    turns = [t for t in await events(kafka_bootstrap, topics["turns"]) if t["rollout_id"] in (retry, wrong)]
    for rollout in (retry, wrong):  # one final segment; last_turn: only the last reply trains
        (segment,) = by_rollout[rollout]
        last = resolve_turns([t for t in turns if t["rollout_id"] == rollout])[-1]
        assert segment["kind"] == "final" and segment["trajectory_reward"] == rewards[rollout]["reward"]
        assert segment["infos"] == rewards[rollout]["infos"]  # the reward's info dicts, byte for byte
        assert trained(segment) == last.output_ids and len(segment["response_ids"]) > len(last.output_ids)
    for writer in coding:  # the segmenter's own all_turns: every reply of every chain trains
        cut = fan_out(writer.expected_chains(), writer.rollout_id, writer.events[-1][1]["reward"])
        got = by_rollout[writer.rollout_id]
        assert [s["kind"] for s in got] == ["subagent", "wipe", "final"]
        assert [trained(s) for s in got] == [
            [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m] for s in cut
        ]

    ckpt = tmp_path / "ckpt"
    config = TrainerSettings.load({
        "bootstrap_servers": kafka_bootstrap, "namespace": ns, "checkpoint_dir": ckpt, "group_size": 2,
        "rollout_batch_size": 2, "steps": 1, "lr": 1e-2, "threads": 1, "logits_chunk": 4, **TINY,
    })  # fmt: skip
    trainer = Trainer(Learner.resume(config))
    initial = {k: v.clone() for k, v in trainer.learner.model.state_dict().items()}
    try:
        await asyncio.wait_for(trainer.run(), 300)  # only a guard against a hang
    except TimeoutError:
        pytest.fail(f"the trainer never took its step: {dict(trainer.counters)}")

    (row,) = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1 and row["groups"] == 2 and row["segments"] == 8  # both kinds, one batch
    assert sorted(trainer.learner.state.finished_groups) == sorted([f"g-code-{tag}", f"g-math-{tag}"])
    assert row["tokens_trained"] == sum(len(trained(s)) for s in segments.values())
    assert trainer.counters.get("dead_letters", 0) == 0
    logged = [json.loads(line) for line in (ckpt / "infos.jsonl").read_text().splitlines()]
    assert {line["rollout_id"]: (line["reward"], line["infos"]) for line in logged} == {
        r: (rewards[r]["reward"], json.loads(rewards[r]["infos"])) for r in (retry, wrong)
    }  # the gym episodes only: coding-agent rollouts carry "[]"
    assert row["infos"] == sum(len(line["infos"]) for line in logged) == 6
    moved = weights(ckpt / "v00000001")
    assert any(not torch.equal(moved[k], initial[k]) for k in moved)
