"""Write the scripted policies of swe-mini: ``scripts/<instance_id>.json`` solves each task through real
Claude Code tool calls (Read the file, Edit it with the task's ``fix_edit``, a final answer);
``scripts-failing/`` holds two that fail on purpose (a wrong fix; deleting the visible tests). The engine
replays a directory of them with ``--script DIR``: a rollout whose id starts with ``<instance_id>-`` (as
``rollbus submit`` names them) gets that task's script.

``scripts-codex/`` holds the same for the Codex CLI's tools (``exec_command`` to read the file, the freeform
``apply_patch`` to fix it, a final answer), and the two failing ones as ``<instance_id>@1.json``, so sample 1
of their groups fails (``rollbus demo --agent codex`` replays it; ``demo-mixed.jsonl`` mixes both harnesses).

    python3 examples/swe-mini/make_scripts.py          # rewrite the scripts from tasks/*/task.json
    python3 examples/swe-mini/make_scripts.py --check  # exit 1 if a script is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKDIR = "/workspace"


def tool_call(reason: str, function: str, **params: str) -> str:
    """One raw model turn in Qwen3-Coder markup: a short reasoning, then one tool call."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"{reason}\n</think>\n\n<tool_call>\n<function={function}>\n{body}</function>\n</tool_call>"


def final(text: str) -> str:
    return f"The change is in place.\n</think>\n\n{text}"


def solving(task: dict) -> dict:
    edit = task["fix_edit"]
    path = f"{WORKDIR}/{edit['path']}"
    return {"turns": [
        tool_call(f"The bug should be in {edit['path']}; read it first.", "Read", file_path=path),
        tool_call("Found the faulty lines; fix them in place.", "Edit", file_path=path,
                  old_string=edit["old_string"].rstrip("\n"), new_string=edit["new_string"].rstrip("\n")),
        final(f"Fixed the bug in `{edit['path']}`."),
    ]}  # fmt: skip


def wrong_fix(task: dict) -> dict:
    """sum-to: an edit that changes the code but keeps it wrong (range(0, n) still leaves out n)."""
    edit = task["fix_edit"]
    path = f"{WORKDIR}/{edit['path']}"
    return {"turns": [
        tool_call(f"Read {edit['path']}.", "Read", file_path=path),
        tool_call("Start the range at 0.", "Edit", file_path=path, old_string="return sum(range(1, n))",
                  new_string="return sum(range(0, n))"),
        final("Changed the range to start at 0."),
    ]}  # fmt: skip


def delete_tests(task: dict) -> dict:
    """binsearch: no fix, the visible tests deleted instead (the grader flags it and scores 0)."""
    return {"turns": [
        tool_call("The tests are in the way; remove them.", "Bash", command=f"rm -r {WORKDIR}/tests",
                  description="Delete the tests"),
        final("Removed the failing tests."),
    ]}  # fmt: skip


FAILING = {"swe-mini__sum-to": wrong_fix, "swe-mini__binsearch": delete_tests}


def patch(path: str, old: str, new: str) -> str:
    """Codex's ``apply_patch`` input replacing the lines ``old`` by ``new`` in ``path`` (workdir-relative)."""
    removed = [f"-{line}" for line in old.rstrip("\n").split("\n")]
    lines = removed + [f"+{line}" for line in new.rstrip("\n").split("\n")]
    return "\n".join(["*** Begin Patch", f"*** Update File: {path}", "@@", *lines, "*** End Patch"])


def codex_solving(task: dict) -> dict:
    edit = task["fix_edit"]
    return {"turns": [
        tool_call(f"The bug should be in {edit['path']}; read it first.", "exec_command",
                  cmd=f"cat {edit['path']}"),
        tool_call("Found the faulty lines; patch them.", "apply_patch",
                  input=patch(edit["path"], edit["old_string"], edit["new_string"])),
        final(f"Fixed the bug in `{edit['path']}`."),
    ]}  # fmt: skip


def codex_wrong_fix(task: dict) -> dict:
    """sum-to: a patch that changes the code but keeps it wrong (range(0, n) still leaves out n)."""
    path = task["fix_edit"]["path"]
    return {"turns": [
        tool_call(f"Read {path}.", "exec_command", cmd=f"cat {path}"),
        tool_call("Start the range at 0.", "apply_patch",
                  input=patch(path, "    return sum(range(1, n))", "    return sum(range(0, n))")),
        final("Changed the range to start at 0."),
    ]}  # fmt: skip


def codex_delete_tests(task: dict) -> dict:
    """binsearch: no fix, the visible tests deleted instead (the grader flags it and scores 0)."""
    return {"turns": [
        tool_call("The tests are in the way; remove them.", "exec_command", cmd="rm -r tests"),
        final("Removed the failing tests."),
    ]}  # fmt: skip


CODEX_FAILING = {"swe-mini__sum-to": codex_wrong_fix, "swe-mini__binsearch": codex_delete_tests}


def scripts() -> dict[Path, dict]:
    out: dict[Path, dict] = {}
    for task_file in sorted((HERE / "tasks").glob("*/task.json")):
        task = json.loads(task_file.read_text())
        out[HERE / "scripts" / f"{task['instance_id']}.json"] = solving(task)
        if task["instance_id"] in FAILING:
            out[HERE / "scripts-failing" / f"{task['instance_id']}.json"] = FAILING[task["instance_id"]](task)
        out[HERE / "scripts-codex" / f"{task['instance_id']}.json"] = codex_solving(task)
        if task["instance_id"] in CODEX_FAILING:
            failing = CODEX_FAILING[task["instance_id"]](task)
            out[HERE / "scripts-codex" / f"{task['instance_id']}@1.json"] = failing
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the scripts are up to date")
    args = parser.parse_args()
    stale = []
    for path, script in scripts().items():
        text = json.dumps(script, indent=2) + "\n"
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("out of date: " + ", ".join(str(p.relative_to(HERE)) for p in stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
