"""The grader's test report: the JSON lines its pytest plugin and unittest runner write, read into test runs.

One test run per pytest session or unittest run in the command (a command may run several). A run that started
and never wrote ``finish`` did not end on its own: it was killed, or left through ``os._exit`` or a signal
from inside a test. A test's status is the worst of its phases: a failed call is FAILED, a failed set-up,
tear-down or collection ERROR, a skip (a module skipped while collected too) SKIPPED, an expected failure
XFAIL, an unexpected pass (non-strict xfail) XPASS; PASSED only when the call passed and nothing else
failed. Pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

PASSED, FAILED, SKIPPED, XFAIL, XPASS, ERROR = "PASSED", "FAILED", "SKIPPED", "XFAIL", "XPASS", "ERROR"
RANK = {PASSED: 0, SKIPPED: 1, XFAIL: 1, XPASS: 2, FAILED: 2, ERROR: 3}
OUTCOME_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
MAX_LINES = 200_000
MAX_NAME = 1000


@dataclass
class TestRun:
    id: str
    finished: bool = False
    exitstatus: int | None = None
    tests: dict[str, str] = field(default_factory=dict)  # test name -> status
    paths: dict[str, str] = field(
        default_factory=dict
    )  # test name -> the absolute file it was collected from
    interrupted: str = ""  # what ended the run early (``Exit``, ``KeyboardInterrupt``); "" when nothing did

    def record(self, name: str, status: str) -> None:
        name = name[:MAX_NAME]
        if name not in self.tests or RANK[status] > RANK[self.tests[name]]:
            self.tests[name] = status


def parse(text: str) -> list[TestRun]:
    """The test runs of a report, in the order they started. ValueError for anything that is not a record
    the grader's own code writes (the file is then not the grader's)."""
    runs: dict[str, TestRun] = {}
    phases: dict[tuple[str, str], dict[str, tuple[str, bool]]] = {}
    pids: dict[str, object] = {}
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise ValueError(f"the report has more than {MAX_LINES} lines")
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"report line {number} is not JSON: {exc}") from None
        if isinstance(record, dict) and record.get("event") == "audit":
            if not all(isinstance(record.get(k), str) for k in ("kind", "actor", "detail")):
                raise ValueError(f"report line {number}: malformed audit record")
            continue  # what the code did while it ran: :func:`audit`
        if not isinstance(record, dict) or not isinstance(record.get("run"), str):
            raise ValueError(f"report line {number} is not a record")
        event, rid = record.get("event"), record["run"]
        if event == "start":
            if rid in runs:
                raise ValueError(f"report line {number}: test run {rid} started twice")
            runs[rid] = TestRun(rid)
            pids[rid] = record.get("pid")
            continue
        run = runs.get(rid)
        if run is None or run.finished:
            raise ValueError(f"report line {number}: {event} outside a running test run")
        if record.get("pid") != pids[rid]:  # a forked copy of the process that claimed the channel
            raise ValueError(f"report line {number}: a record of run {rid} from another process")
        if event == "finish":
            code = record.get("exitstatus")
            if not isinstance(code, int):
                raise ValueError(f"report line {number}: finish without an exit status")
            run.finished, run.exitstatus = True, code
        elif event in ("test", "collect"):
            name, outcome = record.get("nodeid"), record.get("outcome")
            if not isinstance(name, str) or outcome not in ("passed", "failed", "skipped", "error"):
                raise ValueError(f"report line {number}: malformed {event} record")
            if event == "collect":
                run.record(name, SKIPPED if outcome == "skipped" else ERROR)
            else:
                if isinstance(record.get("path"), str) and record["path"]:
                    run.paths.setdefault(name[:MAX_NAME], record["path"][:MAX_NAME])
                when = str(record.get("when", "call"))
                seen = phases.setdefault((rid, name), {})
                new = (outcome, bool(record.get("xfail")))
                if when not in seen or OUTCOME_RANK[outcome] > OUTCOME_RANK[seen[when][0]]:
                    seen[when] = new  # one phase reported twice (a result method calling another): the worse
        elif event == "interrupt":
            run.interrupted = str(record.get("what") or "interrupted")[:100]
        else:
            raise ValueError(f"report line {number}: unknown event {event!r}")
    for (rid, name), by_phase in phases.items():
        runs[rid].record(name, status(by_phase))
    return list(runs.values())


def status(phases: dict[str, tuple[str, bool]]) -> str:
    """One test's status from its phases (``setup``/``call``/``teardown`` -> (outcome, xfail))."""
    outcomes = {when: outcome for when, (outcome, _) in phases.items()}
    if outcomes.get("call") == "failed":
        return FAILED
    if any(o in ("failed", "error") for o in outcomes.values()):
        return ERROR
    if any(o == "skipped" for o in outcomes.values()):
        return XFAIL if any(x for o, x in phases.values() if o == "skipped") else SKIPPED
    call = phases.get("call")
    if call is None:
        return ERROR  # set up and never called: the run stopped under it
    return XPASS if call[1] else PASSED  # a non-strict xfail that passed: not a pass, not a failure


@dataclass(frozen=True)
class AuditEvent:
    """One event the grader's audit hook (or its agreement probe) saw: its kind (``process``, ``native``,
    ``code``, ``frames``, ``framework``, ``open``, ``fixture``, ``agrees``, ``expected``, ``untraced``), the
    file whose code caused it (absolute, in the sandbox; empty when none can be named) and what it was."""

    kind: str
    actor: str
    detail: str


def audit(text: str) -> list[AuditEvent]:
    """The audit records of a report (malformed lines are :func:`parse`'s to reject)."""
    out = []
    for line in text.splitlines()[:MAX_LINES]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == "audit":
            fields = (record.get(k) for k in ("kind", "actor", "detail"))
            values = [v[:MAX_NAME] for v in fields if isinstance(v, str)]
            if len(values) == 3:
                out.append(AuditEvent(*values))
    return out


def paths(runs: list[TestRun]) -> dict[str, set[str]]:
    """Every file each test name was reported from (a name from two files is a name from both)."""
    out: dict[str, set[str]] = {}
    for run in runs:
        for name, path in run.paths.items():
            out.setdefault(name, set()).add(path)
    return out


def merged(runs: list[TestRun]) -> dict[str, str]:
    """Every test of every test run, a name seen twice keeping its worse status."""
    out: dict[str, str] = {}
    for run in runs:
        for name, value in run.tests.items():
            if name not in out or RANK[value] > RANK[out[name]]:
                out[name] = value
    return out
