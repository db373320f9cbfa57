"""services/ and trainer/ have one import name, ``rollbus.services`` / ``rollbus.trainer`` (the packaging map
in setup.py): no code imports the other spelling, and the other spelling cannot make a second copy of a module
(with its own classes and metrics registry) even where the repository root is on ``sys.path``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("services", "trainer")  # mapped to rollbus.<folder>
SCANNED = ("rollbus", "services", "trainer", "tests", "bench", "examples", "scripts", "setup.py")
NOT_OURS = ("examples/swe-mini/tasks/", "tests/cheats/")  # task repositories and attackers' patches


def tracked_python() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *SCANNED],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    python = [p for p in listed if p.endswith(".py") and not p.startswith(NOT_OURS)]
    return [ROOT / p for p in python if (ROOT / p).exists()]


def other_spellings(source: str) -> list[str]:
    """Each absolute import whose first name is a mapped folder's (``services.x``, ``import trainer``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] in FOLDERS]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in FOLDERS:
                found.append(node.module)
    return found


def test_the_scan_finds_the_other_spelling_in_each_form() -> None:
    assert other_spellings("import services.adapter.app\nfrom trainer.loss import x\nimport trainer") == [
        "services.adapter.app", "trainer.loss", "trainer"]  # fmt: skip
    assert other_spellings("from rollbus.services.adapter import app\nfrom . import services") == []


def test_no_code_imports_services_or_trainer_by_the_other_spelling() -> None:
    files = tracked_python()
    assert len(files) > 300  # the scan sees the tree
    offenders = {str(p.relative_to(ROOT)): names for p in files if (names := other_spellings(p.read_text()))}
    assert offenders == {}


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_other_spelling_is_refused_even_with_the_root_on_the_path(folder: str) -> None:
    code = (f"import sys, rollbus.{folder}\n"
            f"try:\n    import {folder}\nexcept ImportError as e:\n    print('refused:', e)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] == {folder!r}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        f"refused: import rollbus.{folder}, not {folder}: the folder {folder}/ has one import name", "[]"]


def test_a_module_run_by_its_path_name_is_refused() -> None:
    """``python -m trainer`` from the root is the other spelling too; ``python -m rollbus.trainer`` is not."""
    wrong = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=ROOT, capture_output=True,
                           text=True)  # fmt: skip
    assert wrong.returncode != 0 and "import rollbus.trainer, not trainer" in wrong.stderr
