"""The grader's own pytest plugin: shipped read-only to ``/eval`` and loaded with ``-p`` in the test sandbox.

It runs the grade's canary tests (:mod:`rollbus.grading.canaries`) at the end of the same session and writes
the report the verdict reads, as JSON lines: every test phase's outcome as the last hook wrapper sees it, and
how the session ended. Code under test shares the process and can rewrite anything here; the canaries (one
must fail, one must pass) are what tells a forged session from an honest one. A must-fail canary is recorded
as it failed and then shown to pytest as passed, so canaries never change pytest's exit status, ``-x`` or
the summary's verdict. Runs under the sandbox's own Python and pytest (7 and later); imports nothing of
rollbus.
"""

import json
import os

import pytest

REPORT = os.environ.get("ROLLBUS_REPORT", "")
CANARIES = frozenset(p for p in os.environ.get("ROLLBUS_CANARIES", "").split(os.pathsep) if p)
MUST_FAIL = frozenset(n for n in os.environ.get("ROLLBUS_MUST_FAIL", "").split(",") if n)
RUN = os.urandom(8).hex()
_canaries_seen = [0]


def _write(record):
    if REPORT:
        with open(REPORT, "a", encoding="utf-8") as out:
            out.write(json.dumps({"run": RUN, **record}) + "\n")


def _is_canary(item):
    path = getattr(item, "path", None) or getattr(item, "fspath", None)
    return str(path) in CANARIES


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        config.args.extend(sorted(CANARIES))
    _write({"event": "start", "pid": os.getpid()})


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(session, config, items):
    canaries = [item for item in items if _is_canary(item)]
    yield
    others = [item for item in items if not _is_canary(item)]  # a -k or -m deselection keeps canaries
    canaries.sort(key=lambda item: item.name in MUST_FAIL)  # must-pass first: -x stops at a must-fail
    items[:] = others + canaries
    _canaries_seen[0] = len(canaries)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    yield
    session.testscollected -= _canaries_seen[0]  # "no tests collected" stays pytest's answer


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    _write(
        {
            "event": "test",
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "xfail": hasattr(report, "wasxfail"),
            "path": str(getattr(item, "path", None) or getattr(item, "fspath", "")),
        }
    )
    if _is_canary(item) and item.name in MUST_FAIL and report.outcome == "failed":
        report.outcome = "passed"
        report.longrepr = None


def pytest_collectreport(report):
    if report.failed or report.skipped:  # a module skipped while collected is a test file that yielded none
        _write({"event": "collect", "nodeid": report.nodeid, "outcome": report.outcome})


def pytest_keyboard_interrupt(excinfo):
    """``pytest.exit`` and ``KeyboardInterrupt`` both end here: the session did not run to its end."""
    _write({"event": "interrupt", "what": type(excinfo.value).__name__})


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _write({"event": "finish", "exitstatus": int(exitstatus), "collected": session.testscollected})
