"""The second, independent run: the required tests again, in fresh interpreters, under another harness.

Code under test shares its process with the harness that judges it, so it can tell that harness apart (its
module names, its environment, its stack) and forge only there. After a first run that solved the row, the
same sandbox (through the same ``sandbox.run`` as the first run, whatever the backend) runs each required test
once more under :mod:`.second_harness`: placed only now, under fresh random names, loaded without
``PYTEST_ADDOPTS`` or any ``ROLLBUS_*`` variable, reporting in a record shape of its own through a unix socket
of its own beside it in ``/eval`` (one connection, made before any repository code; no descriptor passed, so
any backend that mounts ``/eval`` carries it); pytest tests are selected by their absolute file and node id,
pytest started the row's way (its interpreter or ``pytest`` executable, :func:`launch_of`; ``python3 -m
pytest`` when the row names none), unittest tests by id through the harness's own loader under the row's
interpreter instead of the first run's ``TestProgram``. The verdict needs both: every required test collected
again from the file the first run collected it from, its call phase run, passed, the run ended on its own
with status 0.
A cheat tuned to one harness's machinery fails the other.

Before the first run the repository's code files are listed with their inode change times (a container's
copy of the tree in its capped volume: their content digests, read through the engine, :func:`is_code`); one
the first run created or rewrote (a ``conftest.py`` planted while the tests ran, a module rewritten in place)
would be loaded by the second run unscanned, so the second run is then refused. Pure, but for
:func:`place` and :func:`code_files` (files on the host).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rollbus.grading import report

PYTEST, UNITTEST = "pytest", "unittest"
MISSING = "MISSING"
CODE_SUFFIXES = (".py", ".pyc", ".pyw", ".pth", ".so")  # what an interpreter may load as code
CONFIG_NAMES = frozenset({"pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"})  # pytest's
MAX_SELECTORS = 5000


@dataclass(frozen=True)
class Required:
    """One required test as the first run saw it, and how the second run selects it."""

    name: str  # the first report's name (a pytest node id, a unittest id)
    file: str  # absolute in the sandbox: where the first run collected it
    runner: str  # PYTEST or UNITTEST

    @property
    def import_root(self) -> str:
        """unittest: the ``sys.path`` entry the first run imported the test's module from (the file's path
        less the module's dotted name: ``discover -s tests`` names ``test_x.T.t`` from ``tests/``)."""
        stem = PurePosixPath(self.file).with_suffix("")
        parts = list(stem.parts[:-1] if stem.name == "__init__" else stem.parts)
        dotted = self.name.split(".")
        for k in range(min(len(parts) - 1, len(dotted)), 0, -1):
            if dotted[:k] == parts[-k:]:
                return str(PurePosixPath(*parts[:-k]))
        return str(PurePosixPath(*parts[:-1]))

    @property
    def selector(self) -> str:
        """pytest: the absolute file and the node id's rest (independent of pytest's rootdir); unittest: the
        id."""
        return f"{self.file}::{self.name.split('::', 1)[1]}" if self.runner == PYTEST else self.name


def required_tests(names: Iterable[str], files_of: Callable[[str], set[str]]) -> list[Required] | str:
    """The second run's tests: each name with the one file the first run collected it from (pytest when the
    name is a node id, else unittest), or why there is none (a name seen from no file or from two)."""
    out = []
    for name in dict.fromkeys(names):
        files = files_of(name)
        if len(files) != 1:
            return f"{name} was not collected from exactly one file in the first run"
        (file,) = files
        out.append(Required(name, file, PYTEST if "::" in name else UNITTEST))
    if not out:
        return "no required test to run again"
    if len(out) > MAX_SELECTORS:
        return f"more than {MAX_SELECTORS} required tests"
    return out


@dataclass(frozen=True)
class Harness:
    """The second harness as placed for one run: its directory in the sandbox and its module names."""

    directory: str
    module: str
    audit_module: str


REPORT_SOCKET = "r"  # the report socket's file name in the harness's directory


def place(eval_dir: Path, eval_mount: str, audit_root: str, observe: bool = True) -> tuple[Harness, Path]:
    """Write the second harness (and, with ``observe``, a ``sitecustomize`` installing the audit hook) into a
    fresh directory of ``eval_dir`` (mounted at ``eval_mount`` in the sandbox), under fresh names; returns it
    and the host path its report socket is to listen on (:class:`~rollbus.grading.channel.ReportListener`)."""
    here = Path(__file__).resolve().parent
    name = f"h{secrets.token_hex(6)}"
    harness = Harness(f"{eval_mount}/{name}", f"m{secrets.token_hex(6)}", f"a{secrets.token_hex(6)}")
    directory = eval_dir / name
    directory.mkdir()
    report_path = f"{harness.directory}/{REPORT_SOCKET}"
    header = f"REPORT_PATH = {report_path!r}\nAUDIT_MODULE = {harness.audit_module!r}\n"
    source = (here / "second_harness.py").read_text()
    (directory / f"{harness.module}.py").write_text(header + source)
    if observe:
        (directory / f"{harness.audit_module}.py").write_text((here / "sandbox_channel.py").read_text())
        (directory / "sitecustomize.py").write_text(SITE.format(audit=harness.audit_module, root=audit_root))
    return harness, directory / REPORT_SOCKET


SITE = """try:
    import {audit} as _a

    _a.SINK = {{"emit": None, "pending": []}}

    def _emit(record, _sink=_a.SINK):
        if _sink["emit"] is not None:
            _sink["emit"](record)
        elif len(_sink["pending"]) < 5000:
            _sink["pending"].append(record)

    _a.install_audit({root!r}, _emit)
except Exception:
    pass
"""  # the second run's sitecustomize: the audit hook, its records held until the harness claims them


def by_runner(required: Iterable[Required]) -> list[list[Required]]:
    """The required tests as one group per runner (pytest's, then unittest's): each group is one command with
    a harness and a report socket of its own (the socket takes one connection)."""
    tests = list(required)
    return [g for g in ([t for t in tests if t.runner == r] for r in (PYTEST, UNITTEST)) if g]


@dataclass(frozen=True)
class Launch:
    """How the row starts its tests, as far as the second run honours it: the interpreter, and pytest's
    executable when the row runs one instead of ``-m pytest``."""

    python: str = "python3"
    pytest: str = ""  # empty: ``<python> -m pytest``

    @property
    def pytest_command(self) -> str:
        return self.pytest or f"{self.python} -m pytest"


PLAIN_WORD = re.compile(r"^[A-Za-z0-9_./+-]+$")  # no variable, glob or substitution: a word read as written
PYTHON = re.compile(r"^python[0-9.]*$")
PYTEST_SCRIPT = frozenset({"pytest", "py.test"})
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
COMMAND_START = frozenset({"&&", "||", ";", "|", "exec", "then", "do", "else", "time", "!"})


def launch_of(text: str) -> Launch:
    """The row's own way of starting pytest or unittest, read from its command (an eval command, a swepro
    run script): the first command word that is a Python interpreter followed by ``-m pytest`` or
    ``-m unittest``, or a ``pytest`` executable, each a plain word (a path, no variable). Its environment
    assignments, wrappers (``uv run``, ``tox``) and options are not carried: the second run selects its
    own tests and loads its own plugin. ``Launch()`` (``python3``) when none is found."""
    for line in text.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        for at, word in enumerate(words):
            before = words[at - 1] if at else ""
            if not PLAIN_WORD.match(word) or ASSIGNMENT.match(word):
                continue
            if at and before not in COMMAND_START and not ASSIGNMENT.match(before):
                continue  # an argument, not the command word
            name = PurePosixPath(word).name
            if name in PYTEST_SCRIPT:
                return Launch(pytest=word)
            if PYTHON.match(name) and _runs_module(words[at + 1 :]):
                return Launch(python=word)
    return Launch()


def _runs_module(rest: list[str]) -> bool:
    """``rest`` (an interpreter's arguments) is options, then ``-m pytest`` or ``-m unittest``."""
    at = 0
    while at < len(rest):
        word = rest[at]
        if word == "-m":
            return rest[at + 1 : at + 2] in (["pytest"], ["unittest"])
        if not word.startswith("-"):
            return False
        at += 2 if word in ("-X", "-W") else 1  # the options that take a value
    return False


def command(harness: Harness, group: Iterable[Required], launch: Launch | None = None) -> str:
    """The shell command that runs one runner's group (:func:`by_runner`) under ``harness``, started the
    row's way (``launch``, :func:`launch_of`)."""
    launch = launch or Launch()
    tests = list(group)
    ids = " ".join(shlex.quote(t.selector) for t in tests)
    if all(t.runner == PYTEST for t in tests):
        return f"{launch.pytest_command} -q -p no:cacheprovider -p {harness.module} {ids}"
    if any(t.runner == PYTEST for t in tests):
        raise ValueError("one second-run command runs one runner's tests")
    roots = dict.fromkeys(t.import_root for t in tests)
    paths = " ".join(f"--path {shlex.quote(root)}" for root in roots)
    return f"{launch.python} {harness.directory}/{harness.module}.py {paths} {ids}"


def env(harness: Harness) -> dict[str, str]:
    return {"PYTHONPATH": harness.directory}


# -- the report ----------------------------------------------------------------------------------------------


@dataclass
class SecondRun:
    pid: int
    status: int | None = None  # the ``end`` record's; None: it never ended
    halted: str = ""
    lost: list[str] = field(default_factory=list)  # modules skipped or failed while collected
    phases: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)  # (file, id): phase: result


RESULTS = ("passed", "failed", "skipped", "error", "xfail")


def parse(text: str) -> list[SecondRun]:
    """The runs of a second report (one per process that claimed it). ValueError for any line that is not a
    record the second harness writes, a record from a process that never began, or a run begun twice."""
    runs: dict[int, SecondRun] = {}
    lines = text.splitlines()
    if len(lines) > report.MAX_LINES:
        raise ValueError(f"the second report has more than {report.MAX_LINES} lines")
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"second report line {number} is not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
            raise ValueError(f"second report line {number} is not a record")
        if record.get("event") == "audit":
            continue  # the audit hook's, read by :func:`report.audit`
        kind, pid = record.get("e"), record["pid"]
        if kind == "begin":
            if pid in runs:
                raise ValueError(f"second report line {number}: process {pid} began twice")
            runs[pid] = SecondRun(pid)
            continue
        run = runs.get(pid)
        if run is None or run.status is not None:
            raise ValueError(f"second report line {number}: {kind} outside a running test run")
        if kind == "case":
            name, file, phase, result = (record.get(k) for k in ("id", "file", "phase", "result"))
            if not (isinstance(name, str) and isinstance(file, str) and isinstance(phase, str)) or not (
                isinstance(result, str) and result in RESULTS
            ):
                raise ValueError(f"second report line {number}: malformed case")
            seen = run.phases.setdefault((file, name[: report.MAX_NAME]), {})
            if phase not in seen or RESULTS.index(result) > RESULTS.index(seen[phase]):
                seen[phase] = result  # a phase reported twice keeps its worse result
        elif kind == "lost":
            run.lost.append(str(record.get("id", ""))[: report.MAX_NAME])
        elif kind == "halt":
            run.halted = str(record.get("what") or "interrupted")[:100]
        elif kind == "end":
            if not isinstance(record.get("status"), int):
                raise ValueError(f"second report line {number}: end without a status")
            run.status = record["status"]
        else:
            raise ValueError(f"second report line {number}: unknown record {kind!r}")
    return list(runs.values())


def case_status(phases: Mapping[str, str]) -> str:
    """PASSED only when the call ran and passed and no phase failed, errored or skipped."""
    if phases.get("call") == "failed":
        return report.FAILED
    if any(r in ("failed", "error") for r in phases.values()):
        return report.ERROR
    if "xfail" in phases.values():
        return report.XFAIL
    if "skipped" in phases.values():
        return report.SKIPPED
    return report.PASSED if phases.get("call") == "passed" else report.ERROR


def judge(text: str, exit_code: int, required: Iterable[Required]) -> str | None:
    """Why the second run does not show every required test passing, or None when it does."""
    if exit_code < 0 or exit_code >= 128:
        number = -exit_code if exit_code < 0 else exit_code - 128
        name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
        return f"the second run was killed ({name})"
    try:
        runs = parse(text)
    except ValueError as exc:
        return f"the second report is not the grader's: {exc}"
    if not runs:
        return "the second run reported nothing"
    for run in runs:
        if run.status is None:
            return "a second run never finished"
        if run.halted:
            return f"a second run was interrupted ({run.halted})"
        if run.lost:
            return f"the second run lost modules while collecting: {run.lost[:3]}"
    seen: dict[tuple[str, str], list[dict[str, str]]] = {}
    for run in runs:
        for key, phases in run.phases.items():
            seen.setdefault(key, []).append(phases)
    for test in required:
        found = [p for (file, name), ps in seen.items() for p in ps if _same(test, file, name)]
        if not found:
            return f"{test.name} was not collected from {test.file} in the second run"
        worst = [case_status(p) for p in found]
        if any(s != report.PASSED for s in worst):
            return f"{test.name} is {next(s for s in worst if s != report.PASSED)} in the second run"
    if ended := [run.status for run in runs if run.status != 0]:
        return f"a second run ended with status {ended[0]}"
    if exit_code != 0:
        return f"the second run's command exited {exit_code}"
    return None


def statuses(text: str, required: Iterable[Required]) -> dict[str, str]:
    """Each required test's status in the second run (the worst of its cases; MISSING where it has none, and
    for all of them where the report is not the grader's)."""
    tests = list(required)
    try:
        runs = parse(text)
    except ValueError:
        return dict.fromkeys((t.name for t in tests), MISSING)
    out = {}
    for test in tests:
        found = [
            case_status(phases)
            for run in runs
            for (file, name), phases in run.phases.items()
            if _same(test, file, name)
        ]
        out[test.name] = max(found, key=report.RANK.__getitem__) if found else MISSING
    return out


def _same(test: Required, file: str, name: str) -> bool:
    """The second run's ``(file, id)`` is ``test``: the same file, and the same id (pytest: the node id's
    part after the file, which does not depend on the rootdir)."""
    if file != test.file:
        return False
    if test.runner == UNITTEST:
        return name == test.name
    return "::" in name and name.split("::", 1)[1] == test.name.split("::", 1)[1]


# -- what the first run left for the second ------------------------------------------------------------------


def is_code(rel: str) -> bool:
    """A code file or pytest configuration file (a path below the tree's root), ``.git`` aside."""
    name = rel.rpartition("/")[2]
    return not (rel + "/").startswith(".git/") and (name.endswith(CODE_SUFFIXES) or name in CONFIG_NAMES)


def code_files(root: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every code file and pytest configuration file under ``root`` (``.git`` aside) with its inode, size, and
    modification and inode-change times (the last cannot be set back from inside the sandbox); links not
    followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        if dirpath == str(root):
            dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            if name.endswith(CODE_SUFFIXES) or name in CONFIG_NAMES:
                full = os.path.join(dirpath, name)
                try:
                    info = os.lstat(full)
                except OSError:
                    continue
                rel = os.path.relpath(full, root).replace(os.sep, "/")
                out[rel] = (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    return out


def rewritten(before: Mapping[str, tuple[int, ...]], after: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Code files the first run created or changed (deleted ones load nothing)."""
    return sorted(rel for rel, state in after.items() if before.get(rel) != state)
