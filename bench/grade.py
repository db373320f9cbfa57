"""One grade of a swe-mini reference fix: rollbus.grading (sandboxes, order, flags) against a bare baseline.

Run: ``python bench/grade.py [--quick] [--repeats N]``. The baseline, measured in the same run, is what a
grader without any of the protections does: copy the image, ``git apply``, copy the hidden tests in, run the
grading command as a plain subprocess. Prints the median seconds of each per task and the ratio, i.e. what
the sandboxes, the tree measurement and the report cross-checks cost per grade, then one ratio line over all
tasks (total grader time over total bare time) against the budget: the grader stays within 2x of bare, and
what the audit layer costs (the grader with its audit hook over the grader without it, same run).
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
BUDGET = 2.0  # the grader's time per grade, at most this many times a bare apply-and-run


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
    head = f"{'rollbus s':>10} {'no-audit s':>10} {'bare s':>8} {'ratio':>6} {'audit':>6}"
    print(f"{'task':22} {'grader':10} {head}")
    totals = [0.0, 0.0, 0.0]
    unobserved = GradeConfig(observe=False)
    for task in tasks:
        row = all_rows[task]
        spec = parse_row(row, SWE_MINI)
        graded = median_seconds(lambda: asyncio.run(grade(spec, row["label"])), repeats)  # noqa: B023
        unaudited = median_seconds(lambda: asyncio.run(grade(spec, row["label"], unobserved)), repeats)  # noqa: B023
        baseline = median_seconds(lambda: bare(spec, row["label"]), repeats)  # noqa: B023
        kind = type(spec.grader).__name__
        print(
            f"{task:22} {kind:10} {graded:10.3f} {unaudited:10.3f} {baseline:8.3f} {graded / baseline:6.1f}x "
            f"{graded / unaudited:5.2f}x"
        )
        totals = [totals[0] + graded, totals[1] + baseline, totals[2] + unaudited]
    print(ratio_line(len(tasks), *totals))


def ratio_line(tasks: int, graded: float, baseline: float, unaudited: float | None = None) -> str:
    """The bench's one-line answer: the grader's time over bare apply-and-run's, against :data:`BUDGET`, and
    the audit layer's cost (the grader over the grader without its audit hook)."""
    ratio = graded / baseline
    verdict = "within" if ratio <= BUDGET else "OVER"
    audit = f"; audit layer {graded / unaudited:.2f}x" if unaudited else ""
    return (
        f"ratio {ratio:.2f}x over {tasks} tasks (grader {graded:.3f} s, bare {baseline:.3f} s): "
        f"{verdict} the {BUDGET:.0f}x budget{audit}"
    )


if __name__ == "__main__":
    main()
