"""``rollbus <command> --help`` loads no model library: torch, transformers and sglang are imported when a
command runs, never to print its flags (they cost seconds; a help page must answer at once)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollbus.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "sglang")


def imported(stderr: str) -> set[str]:
    """Top-level packages named by ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_imports_no_model_library(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rollbus", name, "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"rollbus {name}" in done.stdout
    names = imported(done.stderr)
    assert "rollbus" in names, "no import lines: -X importtime was not in effect"
    assert not names & set(HEAVY), f"rollbus {name} --help imported {sorted(names & set(HEAVY))}"
