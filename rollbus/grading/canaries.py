"""Canary tests: known answers the grader adds to the test run after the patch, with fresh names per grade.

Code under test that forges results in-process (every report ``passed``, ``TestResult.addFailure`` rebound,
``assertEqual`` made a no-op, failures turned into skips) forges the canaries too, because it cannot tell
them from the row's tests by name: a must-fail canary reported passed, or a must-pass one reported anything
but passed, is tampering. Each kind comes twice, as a plain pytest function (a rewritten ``assert``) and as a
``unittest.TestCase`` method (``assertEqual``), so both frameworks' machinery is watched; a unittest run
collects only the latter, a pytest run both (or only the class where the row's ``python_functions``
differs). Pure: the source and the check; :mod:`rollbus.grading.run` places the file.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PASSED, FAILED = "PASSED", "FAILED"
DID_NOT_RUN = "the canaries did not run"


@dataclass(frozen=True)
class Canaries:
    module: str  # file stem, importable: ``test_<hex>``
    must_pass: tuple[str, str]  # (function, method) names
    must_fail: tuple[str, str]
    source: str

    @property
    def filename(self) -> str:
        return f"{self.module}.py"

    def names(self) -> frozenset[str]:
        return frozenset((*self.must_pass, *self.must_fail))


def make(
    token: Callable[[int], str] = secrets.token_hex, numbers: Callable[[int], int] | None = None
) -> Canaries:
    """Fresh canaries: random names (``test_`` + hex: any default collection finds them), a random sum."""
    draw = numbers or secrets.randbelow
    a, b = draw(10_000) + 1, draw(10_000) + 1
    module, case = f"test_{token(6)}", f"Test{token(6)}"
    passes = (f"test_{token(6)}", f"test_{token(6)}")
    fails = (f"test_{token(6)}", f"test_{token(6)}")
    source = (
        "import unittest\n\n\n"
        f"def {passes[0]}():\n    assert {a} + {b} == {a + b}\n\n\n"
        f"def {fails[0]}():\n    assert {a} + {b} == {a + b + 1}\n\n\n"
        f"class {case}(unittest.TestCase):\n"
        f"    def {passes[1]}(self):\n        self.assertEqual({a} + {b}, {a + b})\n\n"
        f"    def {fails[1]}(self):\n        self.assertEqual({a} + {b}, {a + b + 1})\n"
    )
    return Canaries(module, passes, fails, source)


def short_name(name: str) -> str:
    """The function or method a reported test names (pytest ``a.py::C::t[x]``, unittest ``m.C.t``)."""
    last = name.rsplit("::", 1)[-1].split("[", 1)[0]
    return last.rsplit(".", 1)[-1]


def is_canary(name: str, canaries: Canaries) -> bool:
    return short_name(name) in canaries.names()


def check(results: Mapping[str, str], canaries: Canaries) -> str | None:
    """None when every canary that ran is reported as it must be and at least one of each kind ran; else
    what is wrong. ``results``: reported test name -> status."""
    ran = {short_name(name): status for name, status in results.items() if is_canary(name, canaries)}
    wrong = [f"{n} (must pass) {s}" for n, s in ran.items() if n in canaries.must_pass and s != PASSED]
    wrong += [f"{n} (must fail) {s}" for n, s in ran.items() if n in canaries.must_fail and s != FAILED]
    if wrong:
        return "canaries reported wrongly: " + ", ".join(sorted(wrong))
    if not set(ran) & set(canaries.must_pass) or not set(ran) & set(canaries.must_fail):
        return DID_NOT_RUN
    return None
