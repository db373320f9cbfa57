"""The grader's second harness: an independently written reporter for the second run of the required tests.

Shipped into the test sandbox only after the first run ended, under a fresh random module name in a fresh
random directory of ``/eval`` (so the first run could not list it), with two constants written above this
text: ``REPORT_PATH`` (the unix socket the host listens on, beside this file) and ``AUDIT_MODULE`` (the audit
hook's module, also under a fresh name, whose ``SINK`` the run's ``sitecustomize`` made: the hook's records
wait there until this harness claims the socket, so the interpreter's start imports nothing of the harness
itself). Nothing of the first harness is loaded: no ``rollbus_*`` module, no ``ROLLBUS_*`` variable, no
``PYTEST_ADDOPTS``. The same file is

- a pytest plugin (``-p <name>``): every test's phases as ``pytest_runtest_logreport`` sees them, with the
  file its node id names (absolute), modules lost while collected, fixtures set up from files other than test
  and conftest files (``pytest_fixture_setup``), items whose ``runtest`` was replaced, an ``Exit`` or
  ``KeyboardInterrupt``, and how the session ended;
- a unittest runner (``python3 <file> ID...``): the named tests loaded by name and run by a result class of
  its own;
- the audit hook's sink (the run's ``sitecustomize`` installs the same PEP 578 hook as the first run's, its
  records sent here once claimed).

Records are JSON lines with a key ``e`` (a different shape from the first report's), each stamped with the pid
of the process that claimed the socket. The claim is a connection, made when pytest loads the plugin (or the
runner starts), before any code of the repository; the host accepts that one and stops listening, and the
descriptor is close-on-exec, so a process the tested code starts can neither connect nor inherit it. Runs
under the sandbox's Python; imports nothing of rollbus.
"""

import json
import os
import sys
from typing import Any

# written above this text when shipped (second_run.py); declared here, not assigned
REPORT_PATH: str
AUDIT_MODULE: str

_claim: dict[str, Any] = {"pid": None, "pending": []}


def emit(record):
    """One record into the second report (held until this process claims the socket)."""
    if _claim["pid"] is None:
        if len(_claim["pending"]) < 5000:
            _claim["pending"].append(record)
        return
    line = (json.dumps({**record, "pid": _claim["pid"]}) + "\n").encode()
    try:
        while line:
            line = line[os.write(_claim["fd"], line) :]
    except OSError:
        pass


def claim():
    """This process reports: connected to the host's socket (close-on-exec), held records sent, ``begin``
    written. False when the host takes no connection (another process has it)."""
    if _claim["pid"] is not None:
        return True
    import socket

    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(REPORT_PATH)  # noqa: F821 - declared above, written above this text
            conn.settimeout(None)
            _claim["fd"] = conn.detach()
    except OSError:
        return False
    _claim["pid"] = os.getpid()
    emit({"e": "begin"})
    pending, _claim["pending"] = _claim["pending"], []
    sink = getattr(_audit(), "SINK", None)  # the audit hook's records, held by the run's sitecustomize
    if isinstance(sink, dict):
        pending += sink.get("pending", [])
        sink["pending"], sink["emit"] = [], emit
    for record in pending:
        emit(record)
    return True


def _audit():
    return sys.modules.get(AUDIT_MODULE)  # noqa: F821


def framework_state():
    audit = _audit()
    return audit.framework_classes() if audit is not None else []


def framework_changes(state):
    audit = _audit()
    if audit is not None:
        audit.report_framework_changes(state, emit)


def probe(on):
    """The audit module's agreement probe on or off (nothing without the audit module)."""
    audit = _audit()
    if audit is not None:
        (audit.probe_on if on else audit.probe_off)()


def report_object(kind, obj, detail):
    audit = _audit()
    if audit is not None:
        audit.report_object(kind, obj, detail, emit)


# -- pytest --------------------------------------------------------------------------------------------------

_session: dict[str, Any] = {"framework": [], "fixtures": set(), "claimed": False}


def _from_test_file(func):
    code = getattr(func, "__code__", None)
    if code is None and isinstance(func, type):
        code = getattr(vars(func).get("__init__") or vars(func).get("__new__"), "__code__", None)
    base = os.path.basename(getattr(code, "co_filename", "") or "")
    return base == "conftest.py" or base.startswith("test_") or base.endswith("_test.py")


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: its controller reports
        return
    _session["config"] = config
    _session["claimed"] = claim()


def pytest_sessionstart(session):
    if _session["claimed"]:
        _session["framework"] = framework_state()


def pytest_fixture_setup(fixturedef, request):
    if not _session["claimed"] or id(fixturedef) in _session["fixtures"]:
        return None
    _session["fixtures"].add(id(fixturedef))
    func = getattr(fixturedef, "func", None)
    if func is not None and not _from_test_file(func):
        report_object("fixture", func, "fixture " + str(fixturedef.argname))
    return None


# ``@pytest.hookimpl(tryfirst=True)`` without importing pytest (this module loads in every interpreter): a
# first-result hook, so a conftest's implementation answering first would otherwise hide the fixture from us
pytest_fixture_setup.pytest_impl = {  # type: ignore[attr-defined]  # pluggy reads this marker
    "wrapper": False, "hookwrapper": False, "optionalhook": False, "tryfirst": True, "trylast": False,
    "specname": None,
}  # fmt: skip


def pytest_runtest_teardown(item, nextitem):
    if _session["claimed"] and "runtest" in vars(item):
        report_object("framework", item.runtest, item.nodeid + ": runtest replaced")
        emit({"e": "case", "id": item.nodeid, "file": "", "phase": "call", "result": "error"})


def pytest_runtest_logstart(nodeid, location):
    if _session["claimed"]:
        probe(True)


def pytest_runtest_logfinish(nodeid, location):
    probe(False)


def pytest_runtest_logreport(report):
    if not _session["claimed"]:
        return
    rootdir = str(getattr(_session.get("config"), "rootpath", "") or os.getcwd())
    where = os.path.normpath(os.path.join(rootdir, report.nodeid.split("::", 1)[0]))
    result = "xfail" if hasattr(report, "wasxfail") else report.outcome
    emit({"e": "case", "id": report.nodeid, "file": where, "phase": report.when, "result": result})


def pytest_sessionfinish(session, exitstatus):
    if _session["claimed"]:
        framework_changes(_session["framework"])
        emit({"e": "end", "status": int(exitstatus)})


def pytest_collectreport(report):
    if _session["claimed"] and (report.failed or report.skipped):
        emit({"e": "lost", "id": report.nodeid, "result": report.outcome})


def pytest_keyboard_interrupt(excinfo):
    if _session["claimed"]:
        emit({"e": "halt", "what": type(excinfo.value).__name__})


# -- unittest ------------------------------------------------------------------------------------------------


def run_unittest(names):
    """Load ``names`` (unittest ids) and run them; the exit status is 0 only when every one succeeded."""
    import unittest

    class Result(unittest.TestResult):
        def startTest(self, test):
            super().startTest(test)
            probe(True)

        def stopTest(self, test):
            probe(False)
            super().stopTest(test)

        def _case(self, test, result):
            module = sys.modules.get(type(test).__module__)
            where = getattr(module, "__file__", None) or ""
            emit({"e": "case", "id": test.id(), "file": where, "phase": "call", "result": result})

        def addSuccess(self, test):
            super().addSuccess(test)
            self._case(test, "passed")

        def addFailure(self, test, err):
            super().addFailure(test, err)
            self._case(test, "failed")

        def addError(self, test, err):
            super().addError(test, err)
            self._case(test, "error")

        def addSkip(self, test, reason):
            super().addSkip(test, reason)
            self._case(test, "skipped")

        def addExpectedFailure(self, test, err):
            super().addExpectedFailure(test, err)
            self._case(test, "xfail")

        def addUnexpectedSuccess(self, test):
            super().addUnexpectedSuccess(test)
            self._case(test, "failed")

        def addSubTest(self, test, subtest, err):
            super().addSubTest(test, subtest, err)
            if err is not None:
                self._case(test, "failed" if issubclass(err[0], test.failureException) else "error")

    if not claim():
        return 2
    framework = framework_state()
    try:
        suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    except BaseException as exc:  # a name that does not load: nothing of it ran
        emit({"e": "halt", "what": type(exc).__name__})
        emit({"e": "end", "status": 2})
        return 2
    result = Result()
    suite.run(result)
    ok = result.wasSuccessful() and result.testsRun > 0
    framework_changes(framework)
    emit({"e": "end", "status": 0 if ok else 1})
    return 0 if ok else 1


def main(argv):
    """``[--path ROOT]... ID...``: the working directory first on ``sys.path`` (as ``python -m`` has it), then
    each ROOT the first run imported a test module from."""
    names, roots = [], []
    while argv:
        arg = argv.pop(0)
        if arg == "--path" and argv:
            roots.append(argv.pop(0))
        else:
            names.append(arg)
    sys.path[0:1] = [os.getcwd(), *(r for r in roots if r != os.getcwd())]
    return run_unittest(names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
