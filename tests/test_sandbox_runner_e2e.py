"""The sandbox runner end to end: rows submitted with `rollbus submit`, the runner service consuming `tasks`,
the real Claude Code CLI in bwrap against the real adapter and the scripted engine, `diffs` on a real broker.

Each row's instance id picks its script (the engine's ``--script DIR``), so one engine serves every task:
a fix, an agent that never edits, one that kills its own CLI, one that sleeps past its budget, and an image
that does not exist. A second test kills a runner with ``kill -9`` mid-rollout: the task completes as a new
attempt on the next runner, with the killed attempt's sandbox gone.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rollbus.bus import Publisher
from rollbus.topics import create_topics, topic_name
from tests.conftest import TEST_PARTITIONS
from tests.e2e_support import EXAMPLES, SCRIPTS, Rig
from tests.runner_support import (
    FIXED_LINE,
    RUNNER_SCRIPTS,
    RunnerProcess,
    all_events,
    calc_row,
    group_lag,
    scripts_dir,
    submit,
    wait_for,
    write_dataset,
)

pytestmark = pytest.mark.kafka

BUDGET_S = 40  # the hanging agent's wall-clock budget; every honest rollout here ends well before it
SCRIPTS_BY_TASK = {
    "calc-fix": SCRIPTS / "fix_calc.json",
    "calc-noedit": RUNNER_SCRIPTS / "never_edits.json",
    "calc-crash": RUNNER_SCRIPTS / "crash.json",
    "calc-hang": RUNNER_SCRIPTS / "hang.json",
    "calc-slow": RUNNER_SCRIPTS / "slow_fix.json",
}


async def new_namespace(bootstrap: str) -> str:
    name = f"runner-{uuid.uuid4().hex[:8]}"
    await create_topics(bootstrap, TEST_PARTITIONS, name)
    return name


@pytest.fixture(scope="module")
def rig(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Adapter and one scripted engine replaying every task's own script."""
    work = tmp_path_factory.mktemp("runner-services")
    namespace = asyncio.run(new_namespace(kafka_bootstrap))
    rig = Rig(kafka_bootstrap, namespace, work)
    rig.start()
    rig.use_script(scripts_dir(work / "scripts", SCRIPTS_BY_TASK))
    try:
        yield rig
    finally:
        rig.stop()


def by_instance(diffs: dict[str, list[dict]]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for records in diffs.values():
        for record in records:
            grouped.setdefault(json.loads(record["task_metadata"])["instance_id"], []).append(record)
    return grouped


async def test_rows_to_diffs_with_named_failures(rig: Rig, tmp_path: Path, data_dir: Path) -> None:
    namespace = await new_namespace(rig.bootstrap)
    dataset = write_dataset(data_dir / "tasks.jsonl", [
        calc_row("calc-fix", label="range(1, n + 1)"), calc_row("calc-noedit"), "{not json",
        calc_row("calc-crash"), calc_row("calc-hang"), calc_row("calc-gone", image="no_such_image"),
    ])  # fmt: skip
    submitted = submit(rig.bootstrap, namespace, dataset, "--n-samples-per-prompt", "2")
    assert submitted.returncode == 1, submitted.stderr  # one row was bad, the others went out
    assert f"{dataset}:3: invalid JSON" in submitted.stderr
    assert "submitted 10 tasks (5 rows x 2 samples)" in submitted.stdout
    tasks = await all_events(rig.bootstrap, namespace, "tasks")
    gym = {**tasks[0], "rollout_id": "gym-task-0", "env_config": json.dumps({"env": "frozen_lake"})}
    async with Publisher(rig.bootstrap) as publisher:
        await publisher.publish(topic_name("tasks", namespace), gym)

    runner = RunnerProcess(rig, namespace, tmp_path / "runner", "--concurrency", "5",
                           "--agent-timeout", str(BUDGET_S), "--boot-backoff", "0.1").start()  # fmt: skip
    try:
        diffs = await wait_for(rig.bootstrap, namespace, "diffs", {t["rollout_id"] for t in tasks}, 400)
        await asyncio.sleep(3)  # room for a (wrong) diff of the gym task and for the last commits
        assert await group_lag(rig.bootstrap, namespace, "rollbus-sandbox-runner") == 0
    finally:
        runner.stop()
    every = await all_events(rig.bootstrap, namespace, "diffs")
    assert "gym-task-0" not in {d["rollout_id"] for d in every}, "gym tasks belong to the gym runner"
    assert len(every) == len(tasks), "one diff per task, no duplicates"
    got = by_instance(diffs)
    for instance, records in got.items():
        assert len(records) == 2 and records[0]["group_id"] == records[1]["group_id"], instance
        assert {r["group_size"] for r in records} == {2}
        assert all(r["attempt_id"] for r in records) and records[0]["attempt_id"] != records[1]["attempt_id"]
    for fixed in got["calc-fix"]:
        assert fixed["failure_kind"] is None and fixed["exit_status"] == 0, runner.log()[-3000:]
        assert FIXED_LINE in fixed["patch"] and fixed["turns"] == 3
        assert fixed["label"] == "range(1, n + 1)" and not fixed["patch_truncated"]
        assert json.loads(fixed["task_metadata"])["eval_cmd"] == "python3 -m unittest -q"
    assert {(d["failure_kind"], d["patch"]) for d in got["calc-noedit"]} == {(None, "")}
    assert {d["failure_kind"] for d in got["calc-crash"]} == {"agent_crashed"}
    assert all(d["exit_status"] != 0 for d in got["calc-crash"])
    assert {d["failure_kind"] for d in got["calc-hang"]} == {"timeout"}
    assert all(BUDGET_S <= d["wall_time_s"] < BUDGET_S + 30 for d in got["calc-hang"])
    assert {d["failure_kind"] for d in got["calc-gone"]} == {"boot_failed"}
    assert all("no_such_image" in d["error"] for d in got["calc-gone"])
    assert not list((tmp_path / "runner" / "scratch").iterdir()), "every attempt's workspace was removed"


async def test_runner_killed_mid_rollout_reruns_the_task_as_a_new_attempt(
    rig: Rig, tmp_path: Path, data_dir: Path
) -> None:
    namespace = await new_namespace(rig.bootstrap)
    dataset = write_dataset(data_dir / "slow.jsonl", [calc_row("calc-slow")])
    assert submit(rig.bootstrap, namespace, dataset).returncode == 0
    (task,) = await all_events(rig.bootstrap, namespace, "tasks")
    first = RunnerProcess(rig, namespace, tmp_path / "first", name="first").start()
    try:  # the first attempt is inside its 20 s sleep once its first turn is on the bus
        await wait_for(rig.bootstrap, rig.namespace, "turns", {task["rollout_id"]}, 180)
        await asyncio.sleep(2)
        first.kill9()
    finally:
        first.stop()
    assert not sandbox_processes(tmp_path / "first"), "the killed runner's sandbox died with it"
    second = RunnerProcess(rig, namespace, tmp_path / "second", name="second").start()
    try:
        diffs = await wait_for(rig.bootstrap, namespace, "diffs", {task["rollout_id"]}, 300)
        await asyncio.sleep(2)
        assert await group_lag(rig.bootstrap, namespace, "rollbus-sandbox-runner") == 0
    finally:
        second.stop()
    (diff,) = diffs[task["rollout_id"]]
    assert diff["failure_kind"] is None and FIXED_LINE in diff["patch"], second.log()[-3000:]
    assert len(await all_events(rig.bootstrap, namespace, "diffs")) == 1, (
        "the killed attempt published nothing"
    )
    assert "rollout" in second.log() and "attempt" in second.log()


def sandbox_processes(work: Path) -> list[psutil.Process]:
    """Live processes whose command line names a workspace of ``work`` (a bwrap of that runner)."""
    deadline = time.monotonic() + 10
    while True:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            if any(str(work) in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A dataset directory holding its image: rows name it by a relative path, as users write them."""
    shutil.copytree(EXAMPLES / "buggy_repo", tmp_path / "data" / "buggy_repo")
    return tmp_path / "data"
