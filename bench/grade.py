"""One grade of a swe-mini reference fix: rollbus.grading (sandboxes, order, flags) against a bare baseline.

Run: ``python bench/grade.py [--quick] [--repeats N]``. The baseline, measured in the same run, is what a
grader without any of the protections does: copy the image, ``git apply``, copy the hidden tests in, run the
grading command as a plain subprocess. Prints the median seconds of each per task and the ratio, i.e. what
the sandboxes, the tree measurement, the report cross-checks, the audit hook and the second run cost per
grade, then one ratio line over all tasks (total grader time over total bare time) against the budget (the
grader stays within 2.5x of bare), with what each layer of issue 33 costs, measured in the same run: the
audit layer (the grader with its audit hook over the grader with neither layer) and the second run (the
whole grader over the grader with the audit hook alone).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import shutil
import subprocess
import tempfile
from pathlib import Path

from timing import median_seconds

from rollbus.grading import GradeConfig, grade, parse_row
from rollbus.grading.rows import EvalCmd, F2PScript, GradingSpec, Swepro

SWE_MINI = Path(__file__).resolve().parents[1] / "examples" / "swe-mini"
ENV = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}
BUDGET = 2.5  # the grader's time per grade, at most this many times a bare apply-and-run


def rows() -> dict[str, dict]:
    spec = importlib.util.spec_from_file_location("swe_mini_build", SWE_MINI / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return {row["metadata"]["instance_id"]: row for row in build.build()}


def bare(spec: GradingSpec, patch: str) -> None:
    """The unprotected baseline: no sandbox, no sanitising, no flags, exit status only."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        shutil.copytree(spec.image, repo, symlinks=True)
        subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=repo, check=True)
        for dest, src in spec.eval_files.items():
            shutil.copyfile(src, repo / dest)
        grader = spec.grader
        if isinstance(grader, Swepro):
            subprocess.run(grader.restore_cmd, shell=True, cwd=repo, capture_output=True, check=True)
            cmd = ["bash", str(grader.run_script), ",".join(grader.selected_test_files)]
        elif isinstance(grader, EvalCmd):
            cmd = ["bash", "-c", grader.cmd]
        else:
            assert isinstance(grader, F2PScript)
            (Path(tmp) / "f2p.py").write_text(grader.script)
            cmd = ["python3", str(Path(tmp) / "f2p.py")]
        subprocess.run(cmd, cwd=repo, env=ENV, capture_output=True, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed grades per task and side")
    parser.add_argument("--quick", action="store_true", help="3 repeats, one task per grader kind")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    all_rows = rows()
    tasks = ["swe-mini__lru", "swe-mini__slugify", "swe-mini__roman"] if args.quick else sorted(all_rows)
    head = f"{'rollbus s':>10} {'audit s':>8} {'neither s':>9} {'bare s':>8} {'ratio':>6} {'audit':>6}"
    head += f" {'2nd':>6}"
    print(f"{'task':22} {'grader':10} {head}")
    totals = {"graded": 0.0, "bare": 0.0, "audited": 0.0, "neither": 0.0}
    audit_only = GradeConfig(second_run=False)
    neither = GradeConfig(observe=False, second_run=False)
    for task in tasks:
        row = all_rows[task]
        spec = parse_row(row, SWE_MINI)
        graded = median_seconds(lambda: asyncio.run(grade(spec, row["label"])), repeats)  # noqa: B023
        audited = median_seconds(lambda: asyncio.run(grade(spec, row["label"], audit_only)), repeats)  # noqa: B023
        plain = median_seconds(lambda: asyncio.run(grade(spec, row["label"], neither)), repeats)  # noqa: B023
        baseline = median_seconds(lambda: bare(spec, row["label"]), repeats)  # noqa: B023
        kind = type(spec.grader).__name__
        print(
            f"{task:22} {kind:10} {graded:10.3f} {audited:8.3f} {plain:9.3f} {baseline:8.3f} "
            f"{graded / baseline:5.1f}x {audited / plain:5.2f}x {graded / audited:5.2f}x"
        )
        for key, value in (("graded", graded), ("bare", baseline), ("audited", audited), ("neither", plain)):
            totals[key] += value
    print(ratio_line(len(tasks), totals["graded"], totals["bare"], totals["audited"], totals["neither"]))


def ratio_line(
    tasks: int, graded: float, baseline: float, audited: float | None = None, neither: float | None = None
) -> str:
    """The bench's one-line answer: the grader's time over bare apply-and-run's, against :data:`BUDGET`, and
    what each layer costs: the audit hook (the grader without the second run over the grader with neither)
    and the second run (the whole grader over the grader without it), each also against bare."""
    ratio = graded / baseline
    verdict = "within" if ratio <= BUDGET else "OVER"
    layers = ""
    if audited and neither:
        layers = (
            f"; audit layer {audited / neither:.2f}x (+{(audited - neither) / baseline:.2f} bare)"
            f"; second run {graded / audited:.2f}x (+{(graded - audited) / baseline:.2f} bare)"
        )
    return (
        f"ratio {ratio:.2f}x over {tasks} tasks (grader {graded:.3f} s, bare {baseline:.3f} s): "
        f"{verdict} the {BUDGET:g}x budget{layers}"
    )


if __name__ == "__main__":
    main()
