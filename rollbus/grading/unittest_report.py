"""The grader's own unittest entry point, shipped read-only to ``/eval``: a row's ``python3 -m unittest ARGS``
runs as ``python3 /eval/plugins/rollbus_unittest.py ARGS``.

The same run as ``-m unittest`` (same arguments, the working directory first on ``sys.path``), plus the
grade's canary tests at the end of the suite (compiled in memory from the grader's channel,
:mod:`rollbus_channel`, claimed before any repository code runs), with a result class that writes the report
the verdict reads into that channel (the pytest plugin's JSON lines): each test's outcome as it reaches this
result with its module's file, and how the run ended. Its own modules are imported before the working
directory is on ``sys.path``, so a ``unittest/`` in the repository does not replace the runner. A must-fail
canary is recorded as it failed and then counted as a success, so canaries never change the run's exit
status. Runs under the sandbox's Python; imports nothing of rollbus.
"""

import os
import sys
import types
import unittest

import rollbus_channel as _channel

CONFIG = _channel.claim() or {}
RUN = os.urandom(8).hex()


def write(record):
    _channel.write({"run": RUN, **record})


def is_must_fail(test):
    spec = CONFIG.get("canaries") or {}
    module = spec.get("module") or ""
    name = test.id().rsplit(".", 1)[-1]
    return bool(module) and name in CONFIG.get("must_fail", ()) and test.id().startswith(module + ".")


def canary_module():
    """The grade's canaries, compiled from the channel's source as a module of the first row test
    directory (no file of it exists), or None."""
    spec = CONFIG.get("canaries")
    if not spec or not spec.get("dirs"):
        return None
    path = os.path.join(spec["dirs"][0], spec["module"] + ".py")
    module = types.ModuleType(spec["module"])
    module.__file__ = path
    exec(compile(spec["source"], path, "exec"), module.__dict__)
    return module


class Recording(unittest.TextTestResult):
    def startTest(self, test):
        super().startTest(test)
        _channel.probe_on()  # the agreement probe while the test runs

    def stopTest(self, test):
        _channel.probe_off()
        super().stopTest(test)

    def _record(self, test, outcome, xfail=False):
        module = sys.modules.get(type(test).__module__)
        path = getattr(module, "__file__", None) or ""
        record = {"nodeid": test.id(), "when": "call", "outcome": outcome, "xfail": xfail, "path": path}
        write({"event": "test", **record})

    def addSuccess(self, test):
        self._record(test, "passed")
        super().addSuccess(test)

    def addFailure(self, test, err):
        self._record(test, "failed")
        if is_must_fail(test):
            super().addSuccess(test)
        else:
            super().addFailure(test, err)

    def addError(self, test, err):
        self._record(test, "error")
        super().addError(test, err)

    def addSkip(self, test, reason):
        self._record(test, "skipped")
        super().addSkip(test, reason)

    def addExpectedFailure(self, test, err):
        self._record(test, "skipped", xfail=True)
        super().addExpectedFailure(test, err)

    def addUnexpectedSuccess(self, test):
        self._record(test, "failed", xfail=True)
        super().addUnexpectedSuccess(test)

    def addSubTest(self, test, subtest, err):
        if err is not None:
            failed = issubclass(err[0], test.failureException)
            self._record(test, "failed" if failed else "error")
        super().addSubTest(test, subtest, err)


class Runner(unittest.TextTestRunner):
    # typeshed's TextTestResult defaults its stream type to the runner's decorator, narrower than the runner's
    # own declared stream (and TextTestResult[...] is no runtime subscript before Python 3.12)
    resultclass = Recording  # type: ignore[assignment]


class Program(unittest.TestProgram):
    test: unittest.TestSuite | unittest.TestCase  # made by createTests (typeshed does not declare it)

    def createTests(self, *args, **kwargs):
        super().createTests(*args, **kwargs)
        module = canary_module()
        if module is not None:
            canaries = unittest.defaultTestLoader.loadTestsFromModule(module)
            self.test = unittest.TestSuite([self.test, canaries])


def main():
    sys.path[0] = os.getcwd()  # as ``python -m`` has it
    write({"event": "start"})
    framework = _channel.framework_classes()
    program = Program(module=None, argv=["python -m unittest", *sys.argv[1:]], testRunner=Runner, exit=False)
    result = program.result
    status = 0 if result.wasSuccessful() else 1
    _channel.report_framework_changes(framework)
    write({"event": "finish", "exitstatus": status, "collected": result.testsRun})
    _channel.release()
    sys.exit(status)


if __name__ == "__main__":
    main()
