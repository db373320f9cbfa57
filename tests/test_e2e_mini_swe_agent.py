"""The third harness: a row with ``metadata.agent = "mini_swe_agent"`` runs the real mini-swe-agent (PyPI, its
``mini`` entry point from the pinned venv bootstrap makes) in bwrap against the adapter's OpenAI chat route
and the scripted engine. Its bash tool calls fix the repository, the patch is graded like any other, every
sampled token trains, and its step limit is the runner's ``--max-turns``.

``run_one`` runs one `tasks` record in-process; each row's instance id picks its script.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from tests.e2e_support import EXAMPLES, Rig, Rollout, rollout_events
from tests.runner_support import FIXED_LINE, RUNNER_SCRIPTS, run_and_grade, scripts_dir
from tests.test_e2e_claude_code import assert_trains_every_sampled_token

pytestmark = pytest.mark.kafka

SCRIPTS_BY_TASK = {"mini-fix": RUNNER_SCRIPTS / "mini_swe_agent_fix.json"}


@pytest.fixture(scope="module")
def rig(session_rig: Rig, tmp_path_factory: pytest.TempPathFactory) -> Rig:
    """The session's adapter, its engine serving this module's scripts (a directory: one per instance)."""
    session_rig.ensure_adapter()
    session_rig.use_script(scripts_dir(tmp_path_factory.mktemp("mini-runner-scripts"), SCRIPTS_BY_TASK))
    return session_rig


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLES / "buggy_repo", tmp_path / "data" / "buggy_repo")
    return tmp_path / "data"


run_row = functools.partial(run_and_grade, row_agent="mini_swe_agent")


async def test_a_mini_swe_agent_row_fixes_through_its_bash_tool_and_is_graded_1(
    rig: Rig, data_dir: Path
) -> None:
    """Its first tool call is the attacker's: it looks for the agent's process (bwrap, which holds no secret,
    aside), to read its memory or ptrace it into sending as the agent, being its uid; its environ is the
    probe (the same kernel check). What failed: the venv's python was the host's, dumpable, so it was read.
    It runs an execute-only copy now: refused."""
    diff, reward = await run_row(rig, data_dir, "mini-fix")

    assert diff["failure_kind"] is None and diff["exit_status"] == 0, diff["error"]
    assert FIXED_LINE.encode() in diff["patch"] and b".config" not in diff["patch"]
    assert b"+found\n+environ: refused\n" in diff["patch"] and b"environ: read" not in diff["patch"]
    assert reward == 1.0 and diff["turns"] == 4
    turns = await rollout_events(rig.bootstrap, rig.namespace, "turns", diff["rollout_id"])
    sessions = await rollout_events(rig.bootstrap, rig.namespace, "sessions", diff["rollout_id"])
    assert len(turns) == 4 and {t["chain_id"] for t in turns} == {"main"}
    assert {t["attempt_id"] for t in turns} == {diff["attempt_id"]}
    rollout = Rollout(diff["rollout_id"], None, Path(), turns, sessions)  # type: ignore[arg-type]
    assert_trains_every_sampled_token(rollout, ["final"])


async def test_its_step_limit_is_the_runners_max_turns(rig: Rig, data_dir: Path) -> None:
    """One step allowed: the agent probes, is stopped before its fix, and the attempt says why."""
    diff, reward = await run_row(rig, data_dir, "mini-fix", max_turns=1)

    assert (diff["failure_kind"], diff["turns"]) == ("max_turns", 1), diff["error"]
    assert b"probe.txt" in diff["patch"] and FIXED_LINE.encode() not in diff["patch"]
    assert reward == 0.0
