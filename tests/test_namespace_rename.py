"""scripts/namespace_rename.py rewrites import names, never attributes, and a second run changes nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("namespace_rename", ROOT / "scripts" / "namespace_rename.py")
assert spec is not None and spec.loader is not None
rename = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rename)

KNOWN = {"services": {"adapter", "stack", "segmenter"}, "trainer": {"settings", "main"}}
MODULES = rename.module_pattern(KNOWN)

BEFORE = '''"""Uses :mod:`services.stack.runs` and ``python -m services.adapter``; \
torchrun -m trainer."""
import trainer.main as entry
from services.adapter.app import create_app  # like services.segmenter.rebuild
from trainer import checkpoint
COMMANDS = {"rebuild": ("services.segmenter.rebuild", "x"), "trainer": ("trainer.main", "y")}
argv = [sys.executable, "-m", "trainer"]
other = [sys.executable, "-m", "services.adapter", "--port", "0"]
print(trainer.settings.engine_url, f"{trainer.counters}", "trainer.log", "services/adapter/README.md")
'''
AFTER = '''"""Uses :mod:`rollbus.services.stack.runs` and ``python -m rollbus.services.adapter``; \
torchrun -m rollbus.trainer."""
import rollbus.trainer.main as entry
from rollbus.services.adapter.app import create_app  # like rollbus.services.segmenter.rebuild
from rollbus.trainer import checkpoint
COMMANDS = {"rebuild": ("rollbus.services.segmenter.rebuild", "x"), "trainer": ("rollbus.trainer.main", "y")}
argv = [sys.executable, "-m", "rollbus.trainer"]
other = [sys.executable, "-m", "rollbus.services.adapter", "--port", "0"]
print(trainer.settings.engine_url, f"{trainer.counters}", "trainer.log", "services/adapter/README.md")
'''


def test_imports_strings_and_module_runs_are_renamed_and_attributes_are_not() -> None:
    assert rename.rename_python(BEFORE, MODULES) == AFTER


def test_a_second_run_changes_nothing() -> None:
    assert rename.rename_python(AFTER, MODULES) == AFTER
    text = "run `python -m rollbus.trainer` or `rollbus.services.stack.up`"
    assert rename.rename_words(text, MODULES) == text


def test_pyproject_installs_rollbus_alone_and_ruff_skips_the_links() -> None:
    old = 'include = ["rollbus*", "services*", "trainer*"]\nextend-exclude = ["examples/swe-mini/tasks"]\n'
    new = rename.rename_pyproject(old)
    assert 'include = ["rollbus*"]' in new and '"rollbus/services", "rollbus/trainer"' in new
    assert rename.rename_pyproject(new) == new


def test_the_packages_of_this_repository_are_known() -> None:
    known = rename.modules_of(ROOT)
    assert {"adapter", "stack", "segmenter"} <= known["services"] and {"settings", "main"} <= known["trainer"]
