"""Hidden tests beyond the statement (issue 33): every bundled swe-mini task ships a statement-only probe
(``metadata.statement_probe``: a patch that hard-codes the problem statement's examples and fixes nothing
else), and no probe passes its task's hidden tests, so ``rollbus validate`` marks none of them WEAK.
leapyear's probe (1900 and 2100 answered by name) and lru's (only key ``a`` refreshed) scored 1.0 before their
hidden tests reached past the statement (``test_other_centuries``, ``test_get_refreshes_any_key``).
"""

from __future__ import annotations

from typing import Any

import pytest

from rollbus.grading import grade, parse_row
from tests.test_grading_swe_mini import SWE_MINI, load_build

TASKS = sorted(p.name for p in (SWE_MINI / "tasks").iterdir() if (p / "task.json").is_file())


@pytest.fixture(scope="module")
def built() -> dict[str, dict[str, Any]]:
    return {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}


def test_every_bundled_task_ships_a_statement_probe(built: dict[str, dict[str, Any]]) -> None:
    assert sorted(built) == TASKS and len(TASKS) == 10
    for task, row in built.items():
        probe = row["metadata"].get("statement_probe")
        assert isinstance(probe, str) and probe.startswith("diff --git"), task
        assert probe != row["label"], task


@pytest.mark.parametrize("task", TASKS)
async def test_no_statement_only_fix_passes_the_hidden_tests(
    built: dict[str, dict[str, Any]], task: str
) -> None:
    row = built[task]
    result = await grade(parse_row(row, SWE_MINI), row["metadata"]["statement_probe"])
    assert (result.reward, result.failure_kind, result.flags) == (0.0, "tests_failed", ()), result
