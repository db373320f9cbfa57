"""``rollbus validate DATASET``: every task's gold scores 1 and the empty patch 0, through the real grader.

``DATASET`` is anything ``rollbus submit`` reads (a JSONL of rollbus, SWE-bench or SWE-bench Pro rows, a
Harbor task folder or a folder of them). Per task, each check is one grade (:func:`task_checks`):

- ``load``: the row reads (its format, its fields, its grader);
- ``gold``: the row's label (a Harbor task's ``solution/solve.sh``, through a container backend) scores 1;
- ``empty``: the empty patch scores 0;
- ``probe`` (where a row ships ``metadata.statement_probe``, a patch that only hard-codes the problem
  statement's examples): scoring 1 marks the task *weak* (its hidden tests do not reach past the statement);
  reported, not failed.

The report names every task and, for a failing one, the check and why; the exit status is 1 when any task
fails (2: the dataset cannot be read). Tasks run ``--jobs`` at a time. Each finished task is appended to the
results file (``--results``, default ``DATASET.validate.jsonl``) keyed by its row hash and backend, and a
later run skips the tasks recorded there (``--fresh`` ignores it): a changed task has a new hash.

``--backend`` (the grader's own setting, ``ROLLBUS_GRADER_BACKEND``) picks the sandbox backend by name
(:mod:`rollbus.grading.backends`): ``local`` grades in bwrap over host repository images; ``docker`` is the
container backend's. A Harbor task's gold is its ``solution/solve.sh``: the patch :data:`SOLUTION` tells a
container backend to run it instead of applying a patch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rollbus.grading.rows import HARBOR_SOLUTION
from rollbus.settings import Settings

GOLD, EMPTY, PROBE, LOAD = "gold", "empty", "probe", "load"
GradeRow = Callable[..., Awaitable[Any]]


class ValidateSettings(Settings):
    """Settings of ``rollbus validate`` (flags --x-y, variables ROLLBUS_VALIDATE_X_Y); the grade itself reads
    the grader's (``--grade-timeout``, ``ROLLBUS_GRADER_*``)."""

    model_config = Settings.scoped("validate")
    jobs: int = Field(2, ge=1, le=256, description="tasks validated at once")
    results: Path | None = Field(None, description="results file (default DATASET.validate.jsonl)")
    fresh: bool = Field(False, description="ignore earlier verdicts in the results file (still appended to)")
    format: Literal["rollbus", "swebench", "swepro", "harbor"] | None = Field(
        None, description="the dataset's format (default: detected per row)"
    )
    dataset_revision: str | None = Field(None, description="the dataset's revision, kept on each task")


@dataclass(frozen=True)
class Check:
    check: str
    ok: bool
    why: str = ""
    reward: float | None = None
    failure_kind: str | None = None


@dataclass
class TaskReport:
    task: str
    row_hash: str
    backend: str
    checks: list[Check] = field(default_factory=list)
    weak: bool = False
    skipped: bool = False  # recorded by an earlier run

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_record(self) -> dict[str, Any]:
        return {
            "task": self.task, "row_hash": self.row_hash, "backend": self.backend, "ok": self.ok,
            "weak": self.weak, "checks": [asdict(c) for c in self.checks], "at": int(time.time() * 1000),
        }  # fmt: skip


def judge(check: str, result: Any) -> Check:
    """One grade read as a check: gold must score 1, empty 0; a probe is fine at 0 (weak at 1)."""
    reward, kind = float(result.reward), result.failure_kind
    note = str((result.details or {}).get("note") or "")[:500]
    if check == GOLD:
        why = (
            ""
            if reward == 1.0
            else f"gold scored {reward:g} ({kind or 'no failure kind'})" + (f": {note}" if note else "")
        )
    elif check == EMPTY:
        why = "" if reward == 0.0 else f"the empty patch scored {reward:g}: the tests pass without any fix"
    else:
        why = "" if reward == 0.0 else "the statement-only probe scored 1: the tests stop at its examples"
    return Check(check, not why or check == PROBE, why, reward, kind)


def gold_patch(metadata: Mapping[str, Any], label: str | None) -> str | None:
    """The row's gold: its label (a patch), or None (a Harbor task's gold is its ``solution/solve.sh``, run
    by a container backend's ``grade_row`` when the patch is :data:`SOLUTION`)."""
    if isinstance(metadata.get("harbor"), Mapping) and metadata["harbor"].get("solution"):
        return SOLUTION
    return label if isinstance(label, str) and label.strip() else None


SOLUTION = HARBOR_SOLUTION  # what a container backend reads as "run solution/solve.sh"


async def task_checks(row: Any, base_dir: Path, grade_row: GradeRow, config: Any, backend: str) -> TaskReport:
    """Grade the gold, the empty patch and (if shipped) the statement probe of one row."""
    metadata = row.metadata
    report = TaskReport(row.instance_id, row_hash(metadata, row), backend)
    record = {"metadata": metadata, "label": row.label}
    gold = gold_patch(metadata, row.label)
    if gold is None:
        report.checks.append(Check(GOLD, False, "no gold patch: no label (and no solution/solve.sh)"))
    elif gold == SOLUTION and backend == "local":
        report.checks.append(Check(GOLD, False, "a Harbor solution/solve.sh runs on a container backend"))
    else:
        report.checks.append(judge(GOLD, await grade_row(record, gold, base_dir, config)))
    report.checks.append(judge(EMPTY, await grade_row(record, "", base_dir, config)))
    probe = metadata.get("statement_probe")
    if isinstance(probe, str) and probe.strip():
        checked = judge(PROBE, await grade_row(record, probe, base_dir, config))
        report.weak = checked.reward == 1.0
        report.checks.append(checked)
    return report


def row_hash(metadata: Mapping[str, Any], row: Any) -> str:
    source = metadata.get("source")
    if isinstance(source, Mapping) and isinstance(source.get("row_hash"), str):
        return source["row_hash"]
    from rollbus.task_formats.common import row_hash as digest

    return digest({"prompt": row.prompt, "label": row.label, "metadata": metadata})


def read_results(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Earlier verdicts by (row hash, backend); a torn last line (a killed run) is skipped."""
    done: dict[tuple[str, str], dict[str, Any]] = {}
    if not path.exists():
        return done
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            done[(record["row_hash"], record["backend"])] = record
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def from_record(record: Mapping[str, Any]) -> TaskReport:
    checks = [Check(**c) for c in record.get("checks", [])]
    return TaskReport(record["task"], record["row_hash"], record["backend"], checks, bool(record.get("weak")),
                      skipped=True)  # fmt: skip


async def validate(
    tasks: list[Any],
    base_dir: Path,
    grade_row: GradeRow,
    config: Any,
    backend: str,
    jobs: int,
    results: Path,
    done: Mapping[tuple[str, str], Mapping[str, Any]],
    on_report: Callable[[TaskReport], None] = lambda r: None,
) -> list[TaskReport]:
    """Validate ``tasks`` ``jobs`` at a time, skipping those in ``done``; each new verdict is appended to
    ``results`` as soon as its task finishes (so a killed run loses only the tasks in flight)."""
    slots = asyncio.Semaphore(jobs)
    results.parent.mkdir(parents=True, exist_ok=True)

    async def one(row: Any) -> TaskReport:
        earlier = done.get((row_hash(row.metadata, row), backend))
        if earlier is not None:
            report = from_record(earlier)
        else:
            async with slots:
                report = await task_checks(row, base_dir, grade_row, config, backend)
            with results.open("a", encoding="utf-8") as out:
                out.write(json.dumps(report.as_record()) + "\n")
        on_report(report)
        return report

    return list(await asyncio.gather(*(one(row) for row in tasks)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rollbus.services.grader.settings import GradingOptions

    parser.add_argument("dataset", type=Path, help="JSONL or Harbor task folder(s), as rollbus submit reads")
    ValidateSettings.add_arguments(parser)
    GradingOptions.add_arguments(parser)


def line_of(report: TaskReport) -> str:
    state = "FAIL" if not report.ok else ("WEAK" if report.weak else "ok")
    text = f"{state:4} {report.task}" + (" (earlier run)" if report.skipped else "")
    for check in report.checks:
        if check.why:
            text += f"\n       {check.check}: {check.why}"
    return text


def run(args: argparse.Namespace) -> int:
    from rollbus.rows import Row, RowKeys, read_dataset
    from rollbus.services.grader.core import grade_row
    from rollbus.services.grader.settings import GradingOptions
    from rollbus.task_formats.common import FormatError

    settings = ValidateSettings.from_args(args)
    options = GradingOptions.from_args(args)  # --backend is the grader's (an absent one stops here, named)
    backend = options.backend
    dataset: Path = args.dataset
    try:
        items = list(read_dataset(dataset, RowKeys(), settings.format, settings.dataset_revision))
    except (ValueError, OSError) as exc:  # FormatError is a ValueError
        message = exc.strerror if isinstance(exc, OSError) and not isinstance(exc, FormatError) else exc
        print(f"rollbus validate: {message}", file=sys.stderr)
        return 2
    rows = [item for item in items if isinstance(item, Row)]
    unreadable = [TaskReport(where, "", backend, [Check(LOAD, False, str(error))])
                  for where, error in (i for i in items if not isinstance(i, Row))]  # fmt: skip
    results = settings.results or dataset.with_name(dataset.name + ".validate.jsonl")
    done = {} if settings.fresh else read_results(results)
    base_dir = dataset.resolve() if dataset.is_dir() else dataset.resolve().parent
    for report in unreadable:
        print(line_of(report), flush=True)
    reports = asyncio.run(
        validate(rows, base_dir, grade_row, options.grade_config(), backend, settings.jobs, results,
                 done, on_report=lambda r: print(line_of(r), flush=True))
    )  # fmt: skip
    everything = unreadable + reports
    failed = [r for r in everything if not r.ok]
    weak = [r for r in everything if r.weak]
    skipped = sum(r.skipped for r in reports)
    passed = len(everything) - len(failed)
    print(f"{len(everything)} tasks: {passed} ok, {len(failed)} failed, {len(weak)} weak "
          f"({skipped} from earlier runs in {results}; backend {backend})")  # fmt: skip
    return 1 if failed else 0
