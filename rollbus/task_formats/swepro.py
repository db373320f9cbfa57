"""SWE-bench Pro rows as published -> rollbus rows with the ``swepro`` grader the grader already runs.

The list fields are strings holding Python list literals: read with ``ast.literal_eval`` (never ``eval``) by
:func:`rollbus.grading.rows.string_list`. Only the last line of ``before_repo_set_cmd`` matters (the grader
takes its ``git checkout <fix> -- <tests>`` out of the image's git on the host; the lines before it reset
to the base commit, which every sandbox already starts from). ``run_script.sh`` and ``parser.py`` come from
the row (``run_script_path``/``parser_script_path``) or from ``RUN_SCRIPTS/<instance_id>/`` as the
SWE-bench Pro repository lays them out. The prompt is ``problem_statement``, ``requirements`` and
``interface``, joined as SWE-bench Pro joins them. Image ``jefzda/sweap-images:{dockerhub_tag}``, repository
at ``/app``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollbus.grading.rows import BadRow, parse_restore, string_list
from rollbus.task_formats.common import FormatError, provenance, row_hash, slime_row, text_field

FORMAT = "swepro"
WORKDIR = "/app"
IMAGE_REPOSITORY = "jefzda/sweap-images"
RUN_SCRIPTS = "run_scripts"  # relative to the dataset file, as in scaleapi/SWE-bench_Pro-os
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "before_repo_set_cmd", "dockerhub_tag")
HONOURED = (
    *REQUIRED, "patch", "requirements", "interface", "fail_to_pass", "pass_to_pass",
    "selected_test_files_to_run", "run_script_path", "parser_script_path", "test_patch",
)  # fmt: skip
KEPT = ("repo_language", "issue_specificity", "issue_categories")  # carried, not used


def looks_like(row: Mapping[str, Any]) -> bool:
    return "dockerhub_tag" in row or ("before_repo_set_cmd" in row and "fail_to_pass" in row)


def prompt(row: Mapping[str, Any]) -> str:
    """SWE-bench Pro's prompt: the statement, then its requirements and new interfaces when given."""
    text = row["problem_statement"]
    if row.get("requirements"):
        text += "\n\nRequirements:\n" + str(row["requirements"])
    if row.get("interface"):
        text += "\n\nNew interfaces introduced:\n" + str(row["interface"])
    return text


def read_row(row: Mapping[str, Any], revision: str | None = None) -> dict[str, Any]:
    """One SWE-bench Pro row as a rollbus row (script paths relative to the dataset file)."""
    for key in REQUIRED:
        text_field(row, key, FORMAT)
    instance_id, tag = row["instance_id"], row["dockerhub_tag"]
    if "/" in instance_id or instance_id in (".", ".."):
        raise FormatError(f"{FORMAT}: instance_id {instance_id!r} cannot name a run_scripts directory")
    try:
        fail = string_list(row.get("fail_to_pass"), "fail_to_pass")
        passing = string_list(row.get("pass_to_pass"), "pass_to_pass")
        selected = string_list(row.get("selected_test_files_to_run"), "selected_test_files_to_run")
        lines = [line for line in row["before_repo_set_cmd"].strip().splitlines() if line.strip()]
        parse_restore(lines[-1])
    except BadRow as exc:
        raise FormatError(f"{FORMAT}: {exc}") from None
    if not fail:
        raise FormatError(f"{FORMAT}: fail_to_pass is empty: nothing would tell a fix from no fix")
    scripts = f"{RUN_SCRIPTS}/{instance_id}"
    swepro = {
        "run_script_path": row.get("run_script_path") or f"{scripts}/run_script.sh",
        "parser_script_path": row.get("parser_script_path") or f"{scripts}/parser.py",
        "before_repo_set_cmd": row["before_repo_set_cmd"],
        "selected_test_files": selected,
        "fail_to_pass": fail,
        "pass_to_pass": passing,
    }
    metadata: dict[str, Any] = {
        "instance_id": instance_id,
        "image": row.get("image") or f"{IMAGE_REPOSITORY}:{tag}",
        "workdir": row.get("workdir") or WORKDIR,
        "problem_statement": prompt(row),
        "repo": row["repo"],
        "base_commit": row["base_commit"],
        "swepro": swepro,
        "source": provenance(FORMAT, row_hash(row), revision),
        **{k: row[k] for k in KEPT if row.get(k) not in (None, "")},
    }
    label = row.get("patch") if isinstance(row.get("patch"), str) and row.get("patch") else None
    return slime_row(prompt(row), label, metadata)
