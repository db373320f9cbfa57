"""Values equal to everything, tried as the attacker would (issue 33): a patch that fixes nothing makes the
package's export answer with a value whose ``==`` agrees with any expected result. None is tuned to a
harness, so it forges under the first run and the second alike; each hides its ``__eq__`` from a reading of
the source (one that merely reads its operand, a private mock class, ``setattr`` with a built name,
``functools.partialmethod``, the export made a class). Each scored 1.0 on its grader kind with the
runtime layer off (``GradeConfig(observe=False)``: today's static scan and both runs are fooled), and scores
0 with ``always_equal`` now: the audit layer's probe asks every value the tests compare whether it equals
the test's operand swapped for a random value of its own type and shape, whatever its ``__eq__`` is made
of (``test_grading_compared_values.py``: the probe's pure parts, and forgers no repository frame returns).
The real fixes keep their 1 (``test_grading_swe_mini.py``, ``test_upstream_task.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from rollbus.grading import parse_row
from rollbus.grading.run import GradeConfig
from tests.test_grading_second_run import append_to_file
from tests.test_grading_swe_mini import SWE_MINI, grade_on, load_build, over_backends

READS_OPERAND = [  # eval_cmd pytest: a str whose ``==`` only reads its operand
    "class _Slug(str):",
    "    def __eq__(self, other):",
    "        return other == other",
    "",
    "    __hash__ = str.__hash__",
    "",
    "",
    "_real = slugify",
    "",
    "",
    "def slugify(title):",
    "    return _Slug(_real(title))",
]
PRIVATE_MOCK = [  # eval_cmd unittest: the mock library's private class behind ``ANY``
    "from unittest import mock as _m",
    "",
    "",
    "def sum_to(n):",
    "    return getattr(_m, '_' + 'ANY')()",
]
BUILT_NAME = [  # f2p_script: ``__eq__`` set with a name built at run time
    "class _Middle(float):",
    "    pass",
    "",
    "",
    "setattr(_Middle, '__' + 'eq'[::-1][::-1] + '__', lambda self, other: True)",
    "_Middle.__hash__ = float.__hash__",
    "_real = median",
    "",
    "",
    "def median(values):",
    "    return _Middle(_real(values))",
]
PARTIAL_METHOD = [  # swepro, the upstream parser: ``__eq__`` a partialmethod of a plain function
    "import functools as _f",
    "",
    "",
    "def _answer(self, other, value):",
    "    return value",
    "",
    "",
    "class _Merged(list):",
    "    __eq__ = _f.partialmethod(_answer, value=True)",
    "    __ne__ = _f.partialmethod(_answer, value=False)",
    "",
    "",
    "def merge(intervals):",
    "    return _Merged()",
]
CLASS_AS_FUNCTION = [  # swepro, the other parser: the export is a class, so no repository frame returns it
    "class _Order:",
    "    def __init__(self, *args):",
    "        self.args = args",
    "",
    "",
    "setattr(_Order, '__e' + 'q__', lambda self, other: other == other)",
    "compare = _Order",
]

CHEATS = {  # task: (the package's __init__, the patch's lines)
    "slugify": ("textkit/__init__.py", READS_OPERAND),
    "sum-to": ("calc/__init__.py", PRIVATE_MOCK),
    "median": ("stats/__init__.py", BUILT_NAME),
    "intervals": ("spans/__init__.py", PARTIAL_METHOD),
    "semver": ("versions/__init__.py", CLASS_AS_FUNCTION),
}


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


@pytest.mark.parametrize("backend,task", over_backends(sorted(CHEATS), {"intervals"}))
async def test_a_value_equal_to_everything_scores_zero_under_both_runs(
    rows: dict[str, dict[str, Any]], backend: str, task: str
) -> None:
    """On bwrap for every grader kind, and in a container (the image's Python runs the probe)."""
    init, lines = CHEATS[task]
    patch = append_to_file(task, init, lines)
    spec = parse_row(rows[task], SWE_MINI)
    before = await grade_on(backend)(spec, patch, GradeConfig(observe=False))
    assert (before.reward, before.flags) == (1.0, ()), before  # the scan and both runs are fooled
    after = await grade_on(backend)(spec, patch)
    assert after.reward == 0.0, after
    assert "always_equal" in after.flags, after
    assert any("agrees with anything" in seen for seen in after.details.get("observed", ())), after.details
