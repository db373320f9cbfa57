"""Two clones on one machine share the heavy venv but each runs its own code (scripts/clone_venv.sh,
which `make bootstrap` calls): bootstrapping clone B must not make clone A import B's code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_venv() -> Path:
    """The heavy venv under the one running the tests (itself, or the base of a clone venv)."""
    here = Path(sys.prefix)
    base = here / ".base"
    return Path(base.read_text().strip()) if base.exists() else here


def make_clone(root: Path, name: str) -> Path:
    clone = root / name
    for folder in ("rollbus", "services", "trainer", "schemas"):  # the folders of the packaging map
        shutil.copytree(ROOT / folder, clone / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (clone / "examples").mkdir()  # the demo's data: not needed here
    for file in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / file, clone / file)
    (clone / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "clone_venv.sh", clone / "scripts" / "clone_venv.sh")
    with (clone / "rollbus" / "__init__.py").open("a") as init:
        init.write(f"\nCLONE = {name!r}\n")
    return clone


def bootstrap(clone: Path) -> Path:
    done = subprocess.run([str(clone / "scripts" / "clone_venv.sh"), str(shared_venv()), str(clone)],
                          capture_output=True, text=True, check=True, env=bare_env())  # fmt: skip
    return Path(done.stdout.strip().splitlines()[-1])


def bare_env() -> dict[str, str]:
    """No PYTHONPATH and no activated venv: what a fresh shell in the clone has."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def which_clone(venv: Path, cwd: Path) -> str:
    code = ("import rollbus, rollbus.services.stack, aiokafka;"
            "print(rollbus.CLONE, rollbus.__file__, rollbus.services.stack.__file__)")
    done = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=cwd, capture_output=True, text=True,
                          check=True, env=bare_env())  # fmt: skip
    return done.stdout.strip()


def test_two_clones_bootstrapped_one_after_the_other_each_run_their_own_code(tmp_path: Path) -> None:
    a, b = make_clone(tmp_path, "A"), make_clone(tmp_path, "B")
    venv_a = bootstrap(a)
    venv_b = bootstrap(b)  # the second bootstrap must not re-point the first clone
    assert venv_a == a / ".rollbus" / "venv" and venv_b == b / ".rollbus" / "venv"
    neutral = tmp_path  # neither clone's directory: the code must come from the venv, not the cwd
    assert which_clone(venv_a, neutral) == f"A {a / 'rollbus/__init__.py'} {a / 'services/stack/__init__.py'}"
    assert which_clone(venv_b, neutral) == f"B {b / 'rollbus/__init__.py'} {b / 'services/stack/__init__.py'}"
    command = subprocess.run([str(venv_a / "bin" / "rollbus"), "--help"], cwd=neutral, capture_output=True,
                             text=True, check=True, env=bare_env())  # fmt: skip
    assert "rollbus" in command.stdout
    assert (venv_a / "bin" / "ruff").exists()
    assert bootstrap(a) == venv_a  # idempotent
    assert which_clone(venv_a, neutral).startswith("A ")
