"""The grader's own unittest entry point, shipped read-only to ``/eval``: a row's ``python3 -m unittest ARGS``
runs as ``python3 /eval/plugins/rollbus_unittest.py ARGS``.

The same run as ``-m unittest`` (same arguments, the working directory first on ``sys.path``), plus the
grade's canary tests at the end of the suite, with a result class that writes the report the verdict reads
(the pytest plugin's JSON lines): each test's outcome as it reaches this result, and how the run ended. Its
own modules are imported before the working directory is on ``sys.path``, so a ``unittest/`` in the repository
does not replace the runner. A must-fail canary is recorded as it failed and then counted as a success, so
canaries never change the run's exit status. Runs under the sandbox's Python; imports nothing of rollbus.
"""

import importlib.util
import json
import os
import sys
import unittest

REPORT = os.environ.get("ROLLBUS_REPORT", "")
CANARIES = os.environ.get("ROLLBUS_CANARIES", "").split(os.pathsep)[0]
MUST_FAIL = frozenset(n for n in os.environ.get("ROLLBUS_MUST_FAIL", "").split(",") if n)
RUN = os.urandom(8).hex()


def write(record):
    if REPORT:
        with open(REPORT, "a", encoding="utf-8") as out:
            out.write(json.dumps({"run": RUN, **record}) + "\n")


def is_must_fail(test):
    return test.id().rsplit(".", 1)[-1] in MUST_FAIL and test.id().startswith(canary_module() + ".")


def canary_module():
    return os.path.splitext(os.path.basename(CANARIES))[0]


class Recording(unittest.TextTestResult):
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
    resultclass = Recording


class Program(unittest.TestProgram):
    def createTests(self, *args, **kwargs):
        super().createTests(*args, **kwargs)
        if CANARIES:
            spec = importlib.util.spec_from_file_location(canary_module(), CANARIES)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            canaries = unittest.defaultTestLoader.loadTestsFromModule(module)
            self.test = unittest.TestSuite([self.test, canaries])


def main():
    sys.path[0] = os.getcwd()  # as ``python -m`` has it
    write({"event": "start", "pid": os.getpid()})
    program = Program(module=None, argv=["python -m unittest", *sys.argv[1:]], testRunner=Runner, exit=False)
    result = program.result
    status = 0 if result.wasSuccessful() else 1
    write({"event": "finish", "exitstatus": status, "collected": result.testsRun})
    sys.exit(status)


if __name__ == "__main__":
    main()
