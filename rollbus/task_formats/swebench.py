"""SWE-bench / SWE-Gym / SWE-smith / SWE-rebench rows -> rollbus rows (repository at ``/testbed``).

Grading, SWE-bench's order: the agent's patch, then the files ``test_patch`` touches back to the base commit
and ``test_patch`` applied over them, then pytest over ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (node ids);
solved iff every one passes (pytest's exit status, read through the grader's own pytest plugin). A row whose
tests are not pytest node ids (django's ``test_x (module.Class)``) names its command in ``eval_cmd``.
The image is the row's (``image_name``, ``docker_image`` or ``image``), else SWE-Gym's naming.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

from rollbus.task_formats.common import FormatError, provenance, row_hash, slime_row, text_field

FORMAT = "swebench"
WORKDIR = "/testbed"
IMAGE_KEYS = ("image_name", "docker_image", "image")
# SWE-bench's images keep the repository's environment in conda; a row's own pre_commands win
CONDA = (
    "if [ -f /opt/miniconda3/bin/activate ]; then "
    ". /opt/miniconda3/bin/activate && conda activate testbed; fi"
)
PYTEST = "python3 -m pytest -rA -p no:cacheprovider "
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch")
HONOURED = (
    *REQUIRED, "patch", "FAIL_TO_PASS", "PASS_TO_PASS", *IMAGE_KEYS, "eval_cmd", "pre_commands", "workdir",
)  # fmt: skip
KEPT = ("hints_text", "created_at", "version", "environment_setup_commit")  # carried, not used


def looks_like(row: Mapping[str, Any]) -> bool:
    return all(k in row for k in ("instance_id", "base_commit", "test_patch")) and (
        "FAIL_TO_PASS" in row or "PASS_TO_PASS" in row
    )


def swegym_image(instance_id: str) -> str:
    """SWE-Gym's image name: ``__`` becomes ``_s_``, lowercased."""
    return f"xingyaoww/sweb.eval.x86_64.{instance_id.replace('__', '_s_')}:latest".lower()


def test_list(value: Any, key: str) -> list[str]:
    """A list of test ids, given as a list or a JSON string of one."""
    if value in (None, ""):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise FormatError(f"{FORMAT}: {key} is a string but not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise FormatError(f"{FORMAT}: {key} must be a list of test ids")
    return list(value)


def read_row(row: Mapping[str, Any], revision: str | None = None) -> dict[str, Any]:
    """One SWE-bench-shaped row as a rollbus row."""
    for key in REQUIRED:
        text_field(row, key, FORMAT)
    instance_id = row["instance_id"]
    fail = test_list(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
    passing = test_list(row.get("PASS_TO_PASS"), "PASS_TO_PASS")
    if not fail:
        raise FormatError(f"{FORMAT}: FAIL_TO_PASS is empty: nothing would tell a fix from no fix")
    image = next((row[k] for k in IMAGE_KEYS if isinstance(row.get(k), str) and row[k]), None)
    pre = row.get("pre_commands")
    if pre is not None and not (isinstance(pre, list) and all(isinstance(c, str) for c in pre)):
        raise FormatError(f"{FORMAT}: pre_commands must be a list of shell lines")
    eval_cmd = row.get("eval_cmd")
    if eval_cmd is not None and not isinstance(eval_cmd, str):
        raise FormatError(f"{FORMAT}: eval_cmd must be a string")
    tests = list(dict.fromkeys([*fail, *passing]))
    metadata: dict[str, Any] = {
        "instance_id": instance_id,
        "image": image or swegym_image(instance_id),
        "workdir": row.get("workdir") or WORKDIR,
        "problem_statement": row["problem_statement"],
        "repo": row["repo"],
        "base_commit": row["base_commit"],
        "test_patch": row["test_patch"],
        "fail_to_pass": fail,
        "pass_to_pass": passing,
        "pre_commands": list(pre) if pre is not None else [CONDA],
        "eval_cmd": eval_cmd or PYTEST + " ".join(map(shlex.quote, tests)),
        "source": provenance(FORMAT, row_hash(row), revision),
        **{k: row[k] for k in KEPT if row.get(k) not in (None, "")},
    }
    label = row.get("patch") if isinstance(row.get("patch"), str) and row.get("patch") else None
    return slime_row(row["problem_statement"], label, metadata)
