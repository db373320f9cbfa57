"""The grader's own pytest plugin: shipped read-only to ``/eval`` and loaded with ``-p`` in the test sandbox.

It claims the grader's channel (:mod:`rollbus_channel`, pipes opened before the sandbox started) when pytest
loads it, before any repository code runs; a pytest without the channel (one the code under test started)
reports nothing. It runs the grade's canary tests (:mod:`rollbus.grading.canaries`), built in memory from
the channel's configuration (never a file the tested code could list or read), as modules of the row's
test directories (so the same ``conftest.py`` files apply), after the session's own collection and
deselection; and it writes the report the verdict reads, as JSON lines: every test phase's outcome as the
last hook wrapper sees it with the file the test was collected from, modules skipped or failed while
collected, an ``Exit``/``KeyboardInterrupt``, and how the session ended. A must-fail canary is recorded as
it failed and then shown to pytest as passed, so canaries never change pytest's exit status, ``-x`` or the
summary's verdict. Runs under the sandbox's Python and pytest (7 and later); imports nothing of rollbus.
"""

import ast
import os
import types
from typing import Any

import pytest
import rollbus_channel as _channel

_config = _channel.claim() or {}
# pytest, pluggy, unittest's classes as the session started
_framework: list[tuple[type, dict[str, Any]]] = []
_canary_items: dict[int, pytest.Item] = {}  # id(item) -> item
_canaries_seen = [0]


def _write(record):
    _channel.write({"run": _config.get("run", ""), **record})


def _is_canary(item):
    return id(item) in _canary_items


class _CanaryModule(pytest.Module):
    """A canary module of the grade, compiled from the channel's source: no file of it exists."""

    def _getobj(self):
        spec = _config["canaries"]
        module = types.ModuleType(spec["module"])
        module.__file__ = str(self.path)
        exec(_compiled(spec["source"], str(self.path), self.config), module.__dict__)
        return module


def _compiled(source, path, config):
    """The canaries' code with their ``assert`` rewritten as pytest rewrites a test module's (so what is done
    to the tests' asserts is done to theirs)."""
    tree = ast.parse(source, path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source.encode(), path, config)
    except Exception:  # another pytest's signature: plain asserts still pass and fail as they must
        tree = ast.parse(source, path)
    return compile(tree, path, "exec", dont_inherit=True)


def _collected(node):
    for child in node.collect():
        if isinstance(child, pytest.Item):
            yield child
        else:
            yield from _collected(child)


def _canaries(session, items):
    """The grade's canary items, one module per row test directory, each a child of the collector that
    holds that directory's tests (or of the session)."""
    spec = _config.get("canaries")
    if not spec:
        return []
    parents: dict[str, pytest.Collector] = {}
    for item in items:
        for node in item.listchain():
            path = getattr(node, "path", None)
            directory = isinstance(node, pytest.Collector) and not isinstance(node, pytest.Module)
            if path is not None and directory:
                parents.setdefault(str(path), node)
    found = []
    for directory in spec["dirs"]:
        parent = parents.get(directory, session)
        path = type(session.path)(directory) / (spec["module"] + ".py")
        found.extend(_collected(_CanaryModule.from_parent(parent, path=path)))
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    if _config:  # after pytest configured itself (it sets class attributes then), before collection
        _framework[:] = _channel.framework_classes()


def pytest_configure(config):
    if _config:
        _config.setdefault("run", os.urandom(8).hex())
        _write({"event": "start"})


def outside_test_files(func):
    """Whether a fixture's function lives outside test files and conftest files (an imported function,
    class or module given pytest's fixture marker). Installed plugins' fixtures live under site-packages,
    which :func:`rollbus_channel.report_object` never attributes to the repository."""
    filename = getattr(getattr(func, "__code__", None), "co_filename", "") or ""
    if not filename and isinstance(func, type):
        init = vars(func).get("__init__") or vars(func).get("__new__")
        filename = getattr(getattr(init, "__code__", None), "co_filename", "") or ""
    base = os.path.basename(filename)
    return not (base == "conftest.py" or base.startswith("test_") or base.endswith("_test.py"))


_fixtures_seen: set[int] = set()


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    """Fixtures come from test files, conftest files and installed plugins only: pytest's public hook sees
    every fixture a test actually sets up, whoever registered it; one whose function lives in any other file
    is reported with that file."""
    if not _config or id(fixturedef) in _fixtures_seen:
        return None
    _fixtures_seen.add(id(fixturedef))
    func = getattr(fixturedef, "func", None)
    if func is not None and outside_test_files(func):
        _channel.report_object("fixture", func, f"fixture {fixturedef.argname}")
    return None


def _replaced_runtest(items):
    """An item whose ``runtest`` was replaced on the item itself is reported with the replacing file, and
    its call phase as an error."""
    for item in items:
        if "runtest" in vars(item):
            _channel.report_object("framework", item.runtest, f"{item.nodeid}: runtest replaced")
            record = {"nodeid": item.nodeid, "when": "call", "outcome": "error", "xfail": False}
            _write({"event": "test", **record})


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(session, config, items):
    yield
    if not _config or hasattr(config, "workerinput"):
        return
    _replaced_runtest(items)
    canaries = _canaries(session, items)
    for item in canaries:
        _canary_items[id(item)] = item
    must_fail = set(_config.get("must_fail", ()))
    canaries.sort(key=lambda item: item.name in must_fail)  # must-pass first: -x stops at a must-fail
    items[:] = [item for item in items if not _is_canary(item)] + canaries
    _canaries_seen[0] = len(canaries)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    yield
    session.testscollected -= _canaries_seen[0]  # "no tests collected" stays pytest's answer


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if "runtest" in vars(item) and report.when == "call":  # replaced on the item while it ran: not run
        _channel.report_object("framework", item.runtest, f"{item.nodeid}: runtest replaced")
        record = {"nodeid": report.nodeid, "when": "call", "outcome": "error", "xfail": False}
        _write({"event": "test", **record})
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
    if _is_canary(item) and item.name in _config.get("must_fail", ()) and report.outcome == "failed":
        report.outcome = "passed"
        report.longrepr = None


def pytest_collectreport(report):
    if report.failed or report.skipped:  # a module skipped while collected is a test file that yielded none
        _write({"event": "collect", "nodeid": report.nodeid, "outcome": report.outcome})


def pytest_keyboard_interrupt(excinfo):
    """``pytest.exit`` and ``KeyboardInterrupt`` both end here: the session did not run to its end."""
    _write({"event": "interrupt", "what": type(excinfo.value).__name__})


def pytest_runtest_logstart(nodeid, location):
    if _config:  # from before the test's set-up to after its teardown: the agreement probe
        _channel.probe_on()


def pytest_runtest_logfinish(nodeid, location):
    _channel.probe_off()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _channel.report_framework_changes(_framework)
    _write({"event": "finish", "exitstatus": int(exitstatus), "collected": session.testscollected})


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    _channel.release()
