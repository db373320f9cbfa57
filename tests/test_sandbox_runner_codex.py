"""The sandbox runner with Codex rows: ``metadata.agent = "codex"`` runs the real Codex CLI in bwrap against
the adapter's Responses route and the scripted engine; the patch it leaves is graded like any other.

``run_one`` runs one `tasks` record in-process (what the demo calls); each row's instance id picks its
script, so one engine serves a fix (graded 1) and a wrong fix (graded 0).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbus.grading import GradeConfig
from rollbus.rows import RowKeys, parse_row, tasks_for
from rollbus.services.grader.core import grade_diff
from rollbus.services.sandbox_runner.main import run_one
from rollbus.services.sandbox_runner.settings import RunnerSettings
from rollbus.topics import create_topics
from tests.conftest import TEST_PARTITIONS
from tests.e2e_support import EXAMPLES, Rig, Rollout, rollout_events
from tests.runner_support import FIXED_LINE, RUNNER_SCRIPTS, calc_row, scripts_dir
from tests.test_e2e_claude_code import assert_trains_every_sampled_token

pytestmark = pytest.mark.kafka

SCRIPTS_BY_TASK = {
    "codex-fix": RUNNER_SCRIPTS / "codex_fix.json",
    "codex-wrong": RUNNER_SCRIPTS / "codex_wrong_fix.json",
}


@pytest.fixture(scope="module")
def rig(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("codex-runner-services")
    namespace = f"codex-runner-{uuid.uuid4().hex[:8]}"
    asyncio.run(create_topics(kafka_bootstrap, TEST_PARTITIONS, namespace))
    rig = Rig(kafka_bootstrap, namespace, work)
    rig.start()
    rig.use_script(scripts_dir(work / "scripts", SCRIPTS_BY_TASK))
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES / "buggy_repo", tmp_path / "data" / "buggy_repo")
    return tmp_path / "data"


async def run_row(rig: Rig, data_dir: Path, instance: str, **settings: object) -> tuple[dict, float]:
    """One row run by the runner (``run_one``), then graded as the grader service grades its diff."""
    row = calc_row(instance)
    if "agent" not in settings:
        row["metadata"]["agent"] = "codex"
    (task,) = tasks_for(parse_row(json.dumps(row), 1, RowKeys(), data_dir), 1)
    runner = RunnerSettings.load({"adapter_url": rig.url, "admin_token": rig.admin_token, **settings})
    diff = await run_one(runner, task)
    graded = await grade_diff(diff, data_dir, GradeConfig())
    return diff, graded.reward


async def test_a_codex_row_fixes_through_shell_and_apply_patch_and_is_graded_1(
    rig: Rig, data_dir: Path
) -> None:
    diff, reward = await run_row(rig, data_dir, "codex-fix")

    assert diff["failure_kind"] is None and diff["exit_status"] == 0, diff["error"]
    assert FIXED_LINE.encode() in diff["patch"]
    assert reward == 1.0
    turns = await rollout_events(rig.bootstrap, rig.namespace, "turns", diff["rollout_id"])
    sessions = await rollout_events(rig.bootstrap, rig.namespace, "sessions", diff["rollout_id"])
    assert len(turns) == 3 and {t["chain_id"] for t in turns} == {"main"}
    assert {t["attempt_id"] for t in turns} == {diff["attempt_id"]}
    rollout = Rollout(diff["rollout_id"], None, Path(), turns, sessions)  # type: ignore[arg-type]
    assert_trains_every_sampled_token(rollout, ["final"])


async def test_the_runner_default_agent_applies_to_rows_that_name_none(rig: Rig, data_dir: Path) -> None:
    """A wrong fix, by Codex because ``--agent codex`` is the runner's default: a clean rollout graded 0."""
    diff, reward = await run_row(rig, data_dir, "codex-wrong", agent="codex")

    assert diff["failure_kind"] is None and diff["exit_status"] == 0, diff["error"]
    assert b"+    return sum(range(0, n))" in diff["patch"]
    assert reward == 0.0


async def test_an_unknown_agent_is_a_bad_task_before_any_sandbox(rig: Rig, data_dir: Path) -> None:
    row = calc_row("codex-fix")
    row["metadata"]["agent"] = "aider"
    (task,) = tasks_for(parse_row(json.dumps(row), 1, RowKeys(), data_dir), 1)
    runner = RunnerSettings.load({"adapter_url": rig.url, "admin_token": rig.admin_token})
    diff = await run_one(runner, task)
    assert diff["failure_kind"] == "bad_task" and "metadata.agent" in diff["error"]
    assert diff["patch"] == b""
