"""swe-mini's Codex scripts (what ``rollbus demo --agent codex`` replays), checked without running Codex: they
are what ``make_scripts.py`` writes, and each solving script, parsed as the adapter parses the model's output
(SGLang's Qwen3-Coder parser), reads the buggy file, then patches out lines found exactly once in the task's
repository, leaving the task's reference fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollbus.services.adapter.parsing import parse_output

SWE_MINI = Path(__file__).resolve().parents[1] / "examples" / "swe-mini"
TASKS = sorted((SWE_MINI / "tasks").glob("*/task.json"))
# the two tools of Codex's the scripts call, as the adapter offers them to the parser
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}
    for name, param in (("exec_command", "cmd"), ("apply_patch", "input"))
]  # fmt: skip


def test_the_scripts_are_what_make_scripts_writes() -> None:
    check = [sys.executable, str(SWE_MINI / "make_scripts.py"), "--check"]
    done = subprocess.run(check, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("task_file", TASKS, ids=[t.parent.name for t in TASKS])
def test_each_codex_script_reads_the_file_then_patches_in_the_reference_fix(task_file: Path) -> None:
    task = json.loads(task_file.read_text())
    edit = task["fix_edit"]
    script = json.loads((SWE_MINI / "scripts-codex" / f"{task['instance_id']}.json").read_text())
    read, patch, final = (parse_output(turn, TOOLS) for turn in script["turns"])

    reads = [(c.name, c.arguments) for c in read.tool_calls]
    assert reads == [("exec_command", {"cmd": f"cat {edit['path']}"})]
    assert [c.name for c in patch.tool_calls] == ["apply_patch"] and final.tool_calls == []
    lines = patch.tool_calls[0].arguments["input"].split("\n")
    assert lines[:3] == ["*** Begin Patch", f"*** Update File: {edit['path']}", "@@"], lines
    assert lines[-1] == "*** End Patch" and all(line[:1] in "-+" for line in lines[3:-1]), lines
    removed = "".join(f"{line[1:]}\n" for line in lines[3:-1] if line.startswith("-"))
    added = "".join(f"{line[1:]}\n" for line in lines[3:-1] if line.startswith("+"))
    source = (task_file.parent / "repo" / edit["path"]).read_text()
    assert source.count(removed) == 1  # where apply_patch finds it, with nothing to mistake it for
    assert source.replace(removed, added) == source.replace(edit["old_string"], edit["new_string"])
