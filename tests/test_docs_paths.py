"""The docs name things that exist: every backticked repository path (``rollbus/kafka/bus.py``,
``services/grader/``, ``tests/test_x.py::test_y``), module (``rollbus.kafka.topics.check_topics``) and test
name (``test_only_a_rollouts_first_diff_is_rewarded``) in README.md, docs/ and the service READMEs resolves in
the tree. Code moves (single-service code next to its service, commands into ``rollbus/commands/``); a doc
that still names the old place sends its reader nowhere. Pure: it reads files and imports nothing."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", ROOT / "trainer/README.md", *ROOT.glob("docs/*.md"),
               *ROOT.glob("services/*/README.md")])  # fmt: skip
TOP = ("rollbus/", "services/", "trainer/", "tests/", "bench/", "examples/", "scripts/", "schemas/",
       "compose/", "docs/")  # fmt: skip
MAPPED = {"rollbus.services": "services", "rollbus.trainer": "trainer", "rollbus.schemas": "schemas",
          "rollbus.examples": "examples"}  # setup.py's packaging map  # fmt: skip
# made by the user (from compose/.env.example), never committed; a patch's file the grader flags
NOT_IN_THE_TREE = {"compose/.env", "tests/random.py"}
NOT_TESTS = {"test_patch", "test_framework_internals"}  # a SWE-bench field, a grader flag
# a module, a test (`test_x_...`, `test_x_*`, `test_x[param]`), a test in a file named without its folder
NAME = re.compile(r"rollbus(\.\w+)+|test_\w+(\.\.\.|\*|\[.*\])?|test_\w+\.py::.+")
WILDCARD = re.compile(r"(\.\.\.|\*|\[.*)$")  # `test_x_...`, `test_x_*`, `test_x[param]`


def named(text: str) -> list[str]:
    """The repository paths, modules and test names inside the backticks of a Markdown text."""
    found = []
    for span in re.findall(r"`([^`\n]+)`", text):
        for token in re.findall(r"[^\s,()`]+", span):
            token = token if token.endswith("...") else token.rstrip(".:;")
            if "<" in token or "{" in token:  # a pattern (`schemas/<event>.avsc`), not a name
                continue
            if token.startswith(TOP) or NAME.fullmatch(token):
                found.append(token)
    return found


def module_file(module: str) -> Path | None:
    for name, folder in MAPPED.items():
        if module == name or module.startswith(name + "."):
            module = folder + module.removeprefix(name)
            break
    base = ROOT / module.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def defines(path: Path, name: str) -> bool:
    """Whether ``name`` is bound in the module (defined, assigned or imported), as far as its text says."""
    bound = rf"(def|class)\s+{name}\b|\b{name}\s*[:=]|import\b[^\n]*\b{name}\b|\b{name},"
    return re.search(bound, path.read_text()) is not None


@functools.cache
def defined_tests() -> frozenset[str]:
    files = ROOT.glob("tests/**/*.py")
    return frozenset(name for p in files for name in re.findall(r"def (test_\w+)", p.read_text()))


def problem(token: str, tests: frozenset[str] | set[str]) -> str | None:
    """Why ``token`` names nothing in the tree, or None when it does."""
    if token in NOT_TESTS:
        return None
    if token.startswith("test_") and "::" in token:  # a test file named without its folder
        token = "tests/" + token
    if token.startswith("test_"):
        stem = WILDCARD.sub("", token)
        found = stem in tests or (stem != token and any(t.startswith(stem) for t in tests))
        return None if found else "no test of that name"
    if token.startswith("rollbus."):
        parts = token.split(".")
        for cut in range(len(parts), 1, -1):
            if (path := module_file(".".join(parts[:cut]))) is not None:
                rest = parts[cut:]
                if rest and not defines(path, rest[0]):
                    return f"{path.relative_to(ROOT)} has no {rest[0]}"
                return None
        return "no such module"
    path, _, test = token.partition("::")
    path, _, attribute = path.partition(":")
    if path.rstrip("/") in NOT_IN_THE_TREE:
        return None
    if not (ROOT / path).exists():
        return "no such path"
    if attribute and not defines(ROOT / path, attribute):
        return f"{path} has no {attribute}"
    if test and not test.startswith("*"):
        stem = WILDCARD.sub("", test)
        end = "" if re.search(r"\.\.\.|\*", test) else r"\b"
        if not re.search(rf"def {stem}{end}", (ROOT / path).read_text()):
            return f"{path} has no test {stem}"
    return None


def test_the_scan_reads_each_kind_of_name() -> None:
    text = ("see `rollbus/kafka/bus.py`, `services/adapter/settings.py:AdapterSettings`,"
            " `rollbus.codec.decode` and `tests/test_layers.py::test_x`, `test_y_*`;"
            " not `schemas/<event>.avsc`, `ls -l`, `main.py`, `test_*.py`")  # fmt: skip
    assert named(text) == ["rollbus/kafka/bus.py", "services/adapter/settings.py:AdapterSettings",
                           "rollbus.codec.decode", "tests/test_layers.py::test_x", "test_y_*"]  # fmt: skip


def test_each_kind_of_name_is_looked_up_where_it_lives() -> None:
    tests = {"test_layers_hold", "test_y_one"}
    assert problem("rollbus/kafka/bus.py", tests) is None
    assert problem("rollbus/bus.py", tests) == "no such path"
    assert problem("services/adapter/settings.py:AdapterSettings", tests) is None
    assert problem("services/adapter/settings.py:Nope", tests) == "services/adapter/settings.py has no Nope"
    assert problem("rollbus.kafka.topics.check_topics", tests) is None
    assert problem("rollbus.services.grader.core", tests) is None
    assert problem("rollbus.kafka.topics.nope", tests) == "rollbus/kafka/topics.py has no nope"
    assert problem("rollbus.nowhere", tests) == "no such module"
    assert problem("tests/test_layers.py::test_nope", tests) == "tests/test_layers.py has no test test_nope"
    assert problem("test_y_*", tests) is None and problem("test_y_one", tests) is None
    assert problem("test_y", tests) == "no test of that name"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_module_and_test_a_doc_names_exists(doc: Path) -> None:
    tests = defined_tests()
    names = named(doc.read_text())
    assert names, "the scan finds names in every doc"
    assert {token: why for token in names if (why := problem(token, tests))} == {}
