"""The runner's pure parts, exhaustively: how an attempt's end is named, what
its patch keeps, and which dataset rows become tasks (and why the others do not)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollbus.rows import RowError, RowKeys, parse_row, read_rows, tasks_for
from rollbus.sandbox import Completed
from rollbus.sandbox.capture import Captured
from rollbus.services.sandbox_runner.outcome import AttemptResult, cap_patch, classify, diff_event, drop_paths
from rollbus.services.sandbox_runner.rollout import AttemptFailed, attempt_outcome, chosen_agent, task_prompt
from rollbus.services.sandbox_runner.settings import RunnerSettings
from rollbus.settings import SettingsError

# --- failure kinds ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limited(Completed):
    """A run a sandbox backend ended at a limit (backends that enforce limits name the one hit)."""

    failure_kind: str | None = None


def completed(exit_code: int = 0, stdout: str = "", timed_out: bool = False, **kw) -> Completed:
    return Limited(exit_code, stdout, "", 1.0, timed_out, **kw)


RESULT_OK = json.dumps({"type": "result", "subtype": "success", "num_turns": 3})
RESULT_MAX = json.dumps({"type": "result", "subtype": "error_max_turns", "num_turns": 50})


@pytest.mark.parametrize(
    ("run", "kind"),
    [
        (completed(0, RESULT_OK), None),
        (completed(0, ""), None),  # no result line, exit 0: it ended on its own
        (completed(-9, RESULT_OK, True), "timeout"),
        (completed(1, "not json\n" + RESULT_MAX), "max_turns"),
        (completed(137, ""), "agent_crashed"),
        (completed(-11, "{broken"), "agent_crashed"),
        (completed(137, "", True, failure_kind="memory_limit"), "memory_limit"),  # the sandbox knows best
    ],
)
def test_failure_kind_of_a_run(run: Completed, kind: str | None) -> None:
    assert classify(run) == kind


PATCH = (
    b"diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-a\n+caf\xe9\n"
    b"diff --git a/.claude/settings.json b/.claude/settings.json\nnew file mode 100644\n+{}\n"
    b"diff --git a/.claudeish b/.claudeish\n+x\n"
)


def test_our_own_files_leave_the_patch_and_nothing_else_does() -> None:
    kept = drop_paths(PATCH, [".claude"])
    assert b"calc.py" in kept and b".claudeish" in kept and b".claude/settings.json" not in kept
    assert b"+caf\xe9\n" in kept  # a Latin-1 byte is carried as it is
    assert drop_paths(PATCH, []) == PATCH


@given(st.binary(max_size=300), st.integers(1, 200))
def test_capped_patch_is_a_prefix_of_whole_lines_within_the_cap(patch: bytes, cap: int) -> None:
    cut, truncated = cap_patch(patch, cap)
    assert patch.startswith(cut) and len(cut) <= cap
    assert truncated == (len(patch) > cap)
    if truncated:
        assert cut == b"" or cut.endswith(b"\n")


@pytest.mark.parametrize(
    ("run", "captured", "kind", "patch", "truncated"),
    [
        (completed(0, RESULT_OK), Captured(b"+\xe9\n"), None, b"+\xe9\n", False),
        (completed(0, RESULT_OK), Captured(b"+a\n+b\n", truncated=True), "patch_too_large", b"+a\n", True),
        # git hit the sandbox's memory cap while taking the patch: named, and no partial patch is kept
        (completed(0, RESULT_OK), Captured(b"+a\n", failure="memory_limit"), "patch_failed", b"", False),
        (completed(0, RESULT_OK), Captured(b"", failure="git_failed"), "patch_failed", b"", False),
        # the agent's own failure wins over the capture's
        (completed(0, failure_kind="disk_full"), Captured(b"", failure="timeout"), "disk_full", b"", False),
    ],
)  # fmt: skip
def test_an_attempt_is_named_by_the_agent_then_the_capture_then_the_cap(
    run: Completed, captured: Captured, kind: str | None, patch: bytes, truncated: bool
) -> None:
    outcome = attempt_outcome("att-1", run, captured, max_bytes=5)
    assert (outcome.failure_kind, outcome.patch, outcome.patch_truncated) == (kind, patch, truncated)
    if kind == "patch_failed":
        assert captured.failure in (outcome.error or "")


def test_diff_event_copies_what_the_grader_needs() -> None:
    task = {
        "rollout_id": "r-1",
        "group_id": "g",
        "group_size": 4,
        "metadata": '{"image": "/i"}',
        "label": "L",
    }
    event = diff_event(task, AttemptResult("att-1", b"p\xe9", 0, 2.5, 3), now_ms=7)
    assert event.patch == b"p\xe9"
    assert event.task_metadata == '{"image": "/i"}' and event.label == "L" and event.group_size == 4
    assert (event.attempt_id, event.failure_kind, event.patch_truncated, event.at) == (
        "att-1", None, False, 7,
    )  # fmt: skip
    bare = diff_event({"rollout_id": "r-2"}, AttemptResult("att-2"), now_ms=7)  # what it lacks: the default
    assert (bare.group_id, bare.group_size, bare.task_metadata, bare.label) == ("", 1, "{}", None)


def test_prompt_is_the_problem_statement_in_the_template() -> None:
    task = {"prompt": "from the row"}
    assert task_prompt(task, {"problem_statement": "statement"}, "Fix: {prompt}") == "Fix: statement"
    assert task_prompt(task, {"problem_statement": "  "}, "{prompt}") == "from the row"
    assert task_prompt(task, {}, "{prompt} {prompt}") == "from the row from the row"


def test_settings_refuse_a_template_without_the_prompt_and_bad_shell_words() -> None:
    with pytest.raises(SettingsError, match="--prompt-template"):
        RunnerSettings.load({"prompt_template": "no placeholder"})
    with pytest.raises(SettingsError, match="--cli-args"):
        RunnerSettings.load({"cli_args": "--x 'unbalanced"})
    with pytest.raises(SettingsError, match="--agents-file"):
        RunnerSettings.load({"agents_file": "/nonexistent/agents.json"})
    settings = RunnerSettings.load({"cli_args": "--verbose", "disallowed_tools": "WebFetch, WebSearch,"})
    assert settings.agent_timeout == 1800.0
    assert settings.denied_tools() == ["WebFetch", "WebSearch"] and settings.extra_cli_args() == ["--verbose"]


# --- rows ---------------------------------------------------------------------------------------------

GOOD = {"prompt": "fix it", "metadata": {"image": "repo", "workdir": "/workspace", "eval_cmd": "true"}}


def row_error(data: object) -> str:
    with pytest.raises(RowError) as caught:
        parse_row(data if isinstance(data, str) else json.dumps(data), 1, RowKeys(), Path("/data"))
    return str(caught.value)


def test_a_good_row_resolves_its_paths_against_the_dataset() -> None:
    row = parse_row(json.dumps(GOOD), 4, RowKeys(), Path("/data"))
    assert row.metadata["image"] == "/data/repo" and row.prompt == "fix it" and row.instance_id == "row4"


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ("{not json", "invalid JSON"),
        ([1, 2], "JSON object"),
        ({"prompt": "p", "metadata": "nope"}, "not JSON"),
        ({"prompt": "p", "metadata": {"workdir": "/w"}}, "no image"),
        ({"prompt": "p", "metadata": {"image": "r"}}, "no workdir"),
        ({"prompt": "p", "metadata": {"image": "r", "workdir": "rel"}}, "no workdir"),
        ({"prompt": " ", "metadata": {"image": "r", "workdir": "/w"}}, "no prompt"),
        ({"prompt": "p", "metadata": {**GOOD["metadata"], "remote_env_info": {"f2p_script": "x"}}},
         "2 graders"),
        ({"prompt": "p", "metadata": {"image": "r", "workdir": "/w", "swepro": {"run_script_path": "x"}}},
         "swepro"),
    ],
)  # fmt: skip
def test_bad_rows_say_why(data: object, why: str) -> None:
    assert why in row_error(data)


def test_custom_keys_and_a_statement_instead_of_a_prompt() -> None:
    keys = RowKeys(input_key="question", label_key="answer", metadata_key="info")
    data = {"answer": {"x": 1}, "info": {"image": "/r", "workdir": "/w", "problem_statement": "ps"}}
    row = parse_row(json.dumps(data), 1, keys, Path("/"))
    assert (row.prompt, row.label) == ("ps", '{"x": 1}')


def test_read_rows_reports_line_numbers_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n{bad\n" + json.dumps(GOOD) + "\n")
    items = list(read_rows(path, RowKeys()))
    assert [getattr(i, "line", None) or i[0] for i in items] == [1, 3, 4]
    assert isinstance(items[1], tuple) and "invalid JSON" in str(items[1][1])


def test_samples_share_a_group_and_ids_start_with_the_instance() -> None:
    data = {**GOOD, "metadata": {**GOOD["metadata"], "instance_id": "django__django-1/x"}}
    tasks = tasks_for(parse_row(json.dumps(data), 1, RowKeys(), Path("/d")), 3, now_ms=5)
    assert len({t["group_id"] for t in tasks}) == 1 and [t["sample_index"] for t in tasks] == [0, 1, 2]
    assert all(t["rollout_id"].startswith("django__django-1_x-") for t in tasks)
    assert len({t["rollout_id"] for t in tasks}) == 3 and {t["group_size"] for t in tasks} == {3}
    assert all(t["env_config"] is None and json.loads(t["metadata"])["image"] == "/d/repo" for t in tasks)


def test_the_samples_of_a_row_listing_two_harnesses_run_one_each(tmp_path: Path) -> None:
    """One group compares the harnesses: the tasks of a row whose ``metadata.agent`` lists both take them in
    turn by their sample index; a list naming an unknown harness fails the task as bad, not the runner."""
    row = {**GOOD, "instance_id": "i", "metadata": {**GOOD["metadata"], "agent": ["claude_code", "codex"]}}
    tasks = tasks_for(parse_row(json.dumps(row), 1, RowKeys(), tmp_path), 4)
    settings = RunnerSettings.load({})
    picked = [chosen_agent(json.loads(t["metadata"]), settings, t) for t in tasks]
    assert picked == ["claude_code", "codex", "claude_code", "codex"]
    assert len({t["group_id"] for t in tasks}) == 1
    with pytest.raises(AttemptFailed, match="metadata.agent"):
        chosen_agent({"agent": ["codex", "aider"]}, settings, tasks[0])


def test_none_unsets_a_limit_that_has_a_default_and_anything_else_is_still_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROLLBUS_SANDBOX_RUNNER_DISK_MB", "none")
    settings = RunnerSettings.load({"memory_mb": "None"})
    assert (settings.disk_mb, settings.memory_mb, settings.limits().disk_bytes) == (None, None, None)
    assert settings.pids == 1024
    with pytest.raises(ValueError):
        RunnerSettings.load({"disk_mb": "nothing"})
