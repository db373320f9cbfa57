"""``rollbus <command> --help`` loads no model library: torch, transformers and sglang are imported when a
command runs, never to print its flags (they cost seconds; a help page must answer at once). The services
whose flags are one settings class (``rollbus.cli.ARGUMENTS``) load none of the clients they run on either.
How long a help page takes is measured by ``bench/cli_help.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollbus.cli import ARGUMENTS, COMMANDS, command_parser, settings_class

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "sglang")
# what a service runs on, not what its flags need: Kafka, Avro, numpy, HTTP, the servers, the console, plots
CLIENTS = ("aiokafka", "fastavro", "numpy", "httpx", "uvicorn", "fastapi", "starlette", "faust", "rich",
           "matplotlib")  # fmt: skip


def imported(stderr: str) -> set[str]:
    """Top-level packages named by ``-X importtime`` lines (``import time: self | cumulative | name``)."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def help_imports(name: str) -> set[str]:
    """The top-level packages ``rollbus <name> --help`` imported (it must succeed and print its usage)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rollbus", name, "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"rollbus {name}" in done.stdout
    assert "PydanticUndefined" not in done.stdout, "a required flag's default printed as pydantic's marker"
    names = imported(done.stderr)
    assert "rollbus" in names, "no import lines: -X importtime was not in effect"
    return names


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_imports_no_model_library(name: str) -> None:
    names = help_imports(name)
    assert not names & set(HEAVY), f"rollbus {name} --help imported {sorted(names & set(HEAVY))}"
    if name in ARGUMENTS:
        assert not names & set(CLIENTS), f"rollbus {name} --help imported {sorted(names & set(CLIENTS))}"


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_the_help_parser_is_the_command_s_own(name: str) -> None:
    """The parser built from the settings class alone has exactly the command module's flags."""
    import argparse
    import importlib

    light = argparse.ArgumentParser()
    settings_class(name).add_arguments(light)
    full = command_parser(name, importlib.import_module(COMMANDS[name][0]))
    flags = lambda parser: sorted(s for a in parser._actions for s in a.option_strings)  # noqa: E731
    assert flags(light) == flags(full)
