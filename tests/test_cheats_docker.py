"""The whole grader cheat corpus (``tests/cheats/``) through the container backend, in one batch.

Every case the bwrap tests grade one by one (``test_grading_swe_mini``, ``test_grading_verdict_attacks``,
``test_grading_tree``, ``test_upstream_cheats``) is graded again here by the ``docker`` grading backend: each
cheat scores 0 with the failure kind and flags its own test names, every task's gold fix 1, the empty patch
0 on a task of each grader kind. The grades run side by side (as many as the machine has cores, at most
:data:`CONCURRENCY`), each in fresh network-less containers of the project's cached base image (the rows'
trees are host paths: nothing to build), so the corpus costs one test's wall time; a failure names every
case that went wrong, not the first. A grade here costs about 1 s of engine work more than its bwrap
twin (measured on 2 loaded cores: 2.5 s against 1.6 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass

import pytest

from rollbus.grading import GradingSpec, parse_row
from rollbus.grading.backends import grade_function
from rollbus.grading.verdict import GradeResult
from tests import test_grading_tree as tree
from tests import test_upstream_cheats as upstream
from tests.test_grading_swe_mini import CHEATS, CORPUS, SWE_MINI, load_build
from tests.test_grading_verdict_attacks import CORPUS as VERDICT_CORPUS
from tests.test_grading_verdict_attacks import VERDICT
from tests.test_upstream_task import UPSTREAM
from tests.test_upstream_task import load_build as load_upstream

pytestmark = pytest.mark.docker

CONCURRENCY = 4
EMPTY = (
    "sum-to",
    "flatten",
    "intervals",
)  # the empty patch on one task of each grader kind (the cheats: all)


@dataclass(frozen=True)
class Case:
    """One grade and what it must give: ``flags`` a subset of the grade's, or all of them where ``exact``."""

    name: str
    spec: GradingSpec
    patch: bytes | str
    reward: float
    failure_kind: str | None
    flags: tuple[str, ...] = ()
    exact: bool = False

    def wrong(self, result: GradeResult) -> str | None:
        """Why ``result`` is not what this case must give, or None."""
        got, flags = (result.reward, result.failure_kind), set(result.flags)
        flags_ok = flags == set(self.flags) if self.exact else set(self.flags) <= flags
        digest = str(result.details.get("image_digest", ""))
        if got == (self.reward, self.failure_kind) and flags_ok and digest.startswith("sha256:"):
            return None
        note = str(result.details.get("note", ""))[:300]
        return (
            f"{self.name}: {got} flags {result.flags} in {digest!r}, wanted"
            f" {(self.reward, self.failure_kind)} flags {self.flags}: {note}"
        )


def cases() -> list[Case]:
    """Every task's gold and empty patch, and every cheat of the corpus, with what its bwrap test expects."""
    rows = {row["metadata"]["image"].split("/")[-1]: row for row in load_build().build()}
    specs = {task: parse_row(row, SWE_MINI) for task, row in rows.items()}
    out = [Case(f"gold/{t}", specs[t], rows[t]["label"], 1.0, None, exact=True) for t in sorted(rows)]
    out += [Case(f"empty/{t}", specs[t], "", 0.0, "tests_failed") for t in EMPTY]
    out += [
        Case(c["name"], specs[c["task"]], (CHEATS / f"{c['name']}.patch").read_text(), 0.0, c["failure_kind"],
             tuple(c["flags"]))
        for c in CORPUS
    ]  # fmt: skip
    out += [
        Case(f"verdict/{c['name']}", specs[c["task"]], (VERDICT / f"{c['name']}.patch").read_text(), 0.0,
             c["failure_kind"], tuple(c["flags"]))
        for c in VERDICT_CORPUS
    ]  # fmt: skip
    out += [
        Case(f"tree/{name}", specs[task], (tree.TREE_CHEATS / f"{name}.patch").read_bytes(), 0.0, kind,
             tuple(flags))
        for name, (task, flags, kind) in sorted(tree.CHEATS.items())
    ]  # fmt: skip
    latin1 = (tree.TREE_CHEATS / "latin1_edit_with_gold_fix.patch").read_bytes()  # a legitimate edit: kept
    out.append(Case("tree/latin1_edit_with_gold_fix", specs["lru"], latin1, 1.0, None, exact=True))
    (row,) = load_upstream().build()
    spec = parse_row(row, UPSTREAM)
    out += [
        Case(f"upstream/{name}", spec, upstream.patch_of(name, row), 1.0 if name == upstream.GOLD else 0.0,
             kind, flags, exact=True)
        for name, (_, kind, flags) in upstream.CASES.items()
    ]  # fmt: skip
    return out


@pytest.fixture(scope="module")
def batch() -> list[Case]:
    return cases()


async def test_every_cheat_scores_zero_and_every_gold_fix_one_in_containers(batch: list[Case]) -> None:
    grade = grade_function("docker")
    assert len({case.name for case in batch}) == len(batch) >= 70
    assert {type(c.spec.grader).__name__ for c in batch if c.name.startswith("empty/")} >= {
        "Swepro",
        "EvalCmd",
        "F2PScript",
    }
    gate = asyncio.Semaphore(min(CONCURRENCY, os.cpu_count() or 1))

    async def one(case: Case) -> str | None:
        async with gate:
            return case.wrong(await grade(case.spec, case.patch))

    started = time.monotonic()
    wrong = [w for w in await asyncio.gather(*(one(case) for case in batch)) if w is not None]
    print(f"{len(batch)} grades in containers in {time.monotonic() - started:.1f} s")  # the batch's cost, -s
    assert not wrong, "\n".join(wrong)


def test_the_batch_holds_every_patch_of_the_corpus(batch: list[Case]) -> None:
    """No patch in ``tests/cheats/`` is left out of the container batch (a new one joins it by its test)."""
    names = {case.name.split("/")[-1] for case in batch}
    patches = {p.stem for p in CHEATS.rglob("*.patch")}
    assert patches - names == set(), json.dumps(sorted(patches - names))
