"""Exact refill: a group the trainer will not train is replaced by a new group of the dataset, submitted to
``tasks`` once (the ledger is ``tasks`` itself, read back at start), so each step trains its full batch; a
trainer killed before or after submitting a refill neither loses it nor submits it twice (real Kafka, the
tiny Qwen3 of test_trainer_service)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rollbus.kafka.topics import topic_name
from rollbus.polling import wait_until_async
from rollbus.rows import RowKeys, parse_row
from rollbus.trainer.learner import Learner
from rollbus.trainer.metrics import MetricsLog
from rollbus.trainer.refill import RefillError, Refills, load_refills, refill_token
from rollbus.trainer.service import Trainer
from tests.test_trainer_infra import marker
from tests.test_trainer_service import Killed, group, one_partition_namespace, publish, read_topic, settings

ROWS = [{"prompt": f"fix bug {i}", "metadata": {"image": "repo", "workdir": "/w", "instance_id": f"bug{i}"}}
        for i in range(3)]  # fmt: skip


def rows(base: Path = Path("/data")) -> list:
    return [parse_row(json.dumps(row), i + 1, RowKeys(), base) for i, row in enumerate(ROWS)]


# --------------------------------------------------------------------------- the ledger, as plain data


def test_a_lost_group_is_replaced_by_the_next_row_under_an_id_derived_from_it() -> None:
    refills = Refills(rows(), samples=3)
    what, tasks = refills.plan("g-lost", now_ms=5, reason="zero_variance")
    assert what == "submit" and tasks is not None
    assert {t["refill_reason"] for t in tasks} == {"zero_variance"}
    assert [t["rollout_id"] for t in tasks] == [f"bug0-{refill_token('g-lost')}-{i}" for i in range(3)]
    assert {(t["group_id"], t["group_size"], t["refill_of"], t["prompt"]) for t in tasks} == {
        (f"bug0-{refill_token('g-lost')}", 3, "g-lost", "fix bug 0")
    }
    assert Refills(rows(), samples=3).plan("g-lost", now_ms=99)[1][0]["group_id"] == tasks[0]["group_id"]
    for task in tasks:
        refills.note(task)
    assert refills.plan("g-lost", now_ms=6) == ("already", None)  # at most one replacement per group
    # the next lost group takes the next row, cycling through the dataset
    names = []
    for lost in ("h", "i", "j"):
        _, more = refills.plan(lost, now_ms=7)
        names.append(more[0]["prompt"])
        for task in more:
            refills.note(task)
    assert names == ["fix bug 1", "fix bug 2", "fix bug 0"]


def test_the_ledger_read_back_from_tasks_decides_what_is_already_replaced() -> None:
    written = Refills(rows(), samples=2)
    _, tasks = written.plan("g", now_ms=1)
    recovered = Refills(rows(), samples=2)
    for record in [{"group_id": "other", "refill_of": None}, *tasks]:  # any task: only refills count
        recovered.note(record)
    assert recovered.plan("g", now_ms=2) == ("already", None)
    assert recovered.plan("h", now_ms=2)[1][0]["prompt"] == "fix bug 1"  # the cursor continues


def test_replacements_of_replacements_stop_at_the_depth_limit() -> None:
    refills = Refills(rows(), samples=2, max_depth=2)
    lost = "g"
    for depth in range(2):
        assert refills.depth(lost) == depth
        what, tasks = refills.plan(lost, now_ms=1)
        assert what == "submit"
        for task in tasks:
            refills.note(task)
        lost = tasks[0]["group_id"]  # the replacement itself lost its variance
    assert refills.depth(lost) == 2 and refills.plan(lost, now_ms=1) == ("too_deep", None)


def test_an_unusable_refill_dataset_is_refused_in_one_line(tmp_path: Path) -> None:
    assert load_refills(None, 2, 3) is None
    with pytest.raises(RefillError, match="no row could become a task"):
        (tmp_path / "bad.jsonl").write_text('{"prompt": "p"}\n')
        load_refills(tmp_path / "bad.jsonl", 2, 3)
    with pytest.raises(RefillError, match="missing.jsonl"):
        load_refills(tmp_path / "missing.jsonl", 2, 3)


# --------------------------------------------------------------------------- the trainer, on a real broker


async def refills_on(bootstrap: str, namespace: str) -> list[dict]:
    return [e.record for e in await read_topic(bootstrap, topic_name("tasks", namespace))
            if e.record.get("refill_of")]  # fmt: skip


def lost_group(why: str) -> list[dict]:
    """Group "z", which will not train: both samples scored the same, or one sample is left after an
    infrastructure failure (the segmenter's marker, at the same segment time)."""
    if why == "zero_variance":
        return group("z", [1.0, 1.0], [1, 1])
    return group("z", [1.0], [1]) + [{**marker("z-r1", "z"), "created_at": 0}]


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("why", "phase"),
    [("zero_variance", None), ("zero_variance", "before_refill"), ("zero_variance", "after_refill"),
     ("infrastructure", None)],
)  # fmt: skip
async def test_a_lost_group_is_refilled_once_and_the_step_trains_its_full_batch(
    kafka_bootstrap: str, tmp_path: Path, why: str, phase: str | None
) -> None:
    """Batch of 2 groups: "z" will not train (no reward variance, or lost to infrastructure), "a" trains;
    the trainer submits one group for "z", whose rollouts (published here as the pipeline would) fill the
    step. Killed at ``phase`` and restarted, the trainer still submits that group exactly once."""
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    namespace = await one_partition_namespace(kafka_bootstrap)
    await publish(kafka_bootstrap, namespace, lost_group(why) + group("a", [1.0, 0.0], [1, 2]))
    config = settings(kafka_bootstrap, namespace, tmp_path / "ckpt", steps=1, rollout_batch_size=2,
                      refill_dataset=dataset)  # fmt: skip
    if phase is not None:

        def kill(at: str) -> None:
            if at == phase:
                raise Killed(at)

        with pytest.raises(Killed):
            await asyncio.wait_for(Trainer(Learner.resume(config), fault=kill).run(), 120)
    trainer = Trainer(Learner.resume(config))
    running = asyncio.create_task(trainer.run())
    try:

        async def submitted() -> bool:
            return bool(await refills_on(kafka_bootstrap, namespace)) or running.done()

        await wait_until_async(submitted, timeout=120, what="the refill on tasks")
        tasks = await refills_on(kafka_bootstrap, namespace)
        assert [(t["refill_of"], t["refill_reason"], t["sample_index"]) for t in tasks] == [
            ("z", why, 0),
            ("z", why, 1),
        ]
        replacement = tasks[0]["group_id"]
        assert replacement == f"bug0-{refill_token('z')}"
        await publish(kafka_bootstrap, namespace, group(replacement, [0.0, 1.0], [1, 1]))
        await asyncio.wait_for(running, 120)
    finally:
        running.cancel()
    (row,) = MetricsLog(tmp_path / "ckpt").rows()
    assert row["group_ids"] == ["a", replacement]
    dropped = "zero_variance_groups_skipped" if why == "zero_variance" else "infrastructure_groups_dropped"
    assert row[dropped] == 1
    assert row["refills_submitted"] == 1
    assert len(await refills_on(kafka_bootstrap, namespace)) == 2  # one group, never submitted twice
