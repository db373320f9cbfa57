"""The rollbus command: subcommands listed, flags documented, environment fallbacks honoured."""

import argparse
import importlib
import subprocess
import sys

import pytest

from rollbus.cli import COMMANDS, command_parser, main


def test_help_lists_every_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollbus", "--help"], capture_output=True, text=True, check=True
    )
    for name in COMMANDS:
        assert name in out.stdout


def help_of(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``rollbus <name> --help`` on one long line (argparse would wrap, even inside a word)."""
    with pytest.MonkeyPatch.context() as wide, pytest.raises(SystemExit) as done:
        wide.setenv("COLUMNS", "10000")
        main([name, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal width: unwrap


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_documents_every_option_it_reads(name: str, capsys) -> None:
    """Every option the command's parser takes is in its --help with its help text, its environment
    variable (where it has one) and a default as a person would type it, not a Python repr."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = command_parser(name, module)
    text = help_of(name, capsys)
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert options, f"rollbus {name} takes no options?"
    for action in options:
        assert action.help not in (None, argparse.SUPPRESS), f"{action.option_strings} has no help"
        assert max(action.option_strings, key=len) in text, f"{action.option_strings} missing from --help"
        assert " ".join(action.help.split()[:3]).replace("%%", "%") in text
    for repr_marker in ("PosixPath(", " object at 0x", "<function"):
        assert repr_marker not in text


def test_unknown_subcommand_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["no-such-thing"])
    assert done.value.code == 2


def settings_classes(module: object) -> list[type]:
    from rollbus.settings import Settings

    return [
        v for v in vars(module).values()
        if isinstance(v, type) and issubclass(v, Settings) and v.__module__ != "rollbus.settings"
    ]  # fmt: skip


@pytest.mark.parametrize("name", ["adapter", "engine"])
def test_every_setting_is_a_flag_and_a_variable_in_help(name: str, capsys) -> None:
    """The settings class is the only declaration: each field shows in --help as its flag, its variable
    and its default as typed."""
    module = importlib.import_module(COMMANDS[name][0])
    (cls,) = {c for c in settings_classes(module) if c.__name__.lower().startswith(name)}
    text = help_of(name, capsys)
    for field in cls.model_fields:
        assert f"{cls.flag(field)} " in text, f"{cls.flag(field)} missing from rollbus {name} --help"
        assert cls.env_var(field) in text
    assert f"ROLLBUS_{name.upper()}_PORT" in text and "ROLLBUS_STATE_DIR" in text or name == "engine"


BAD_VALUES = [  # (command, flag or variable, value, words the one line must contain): one per kind of option
    ("adapter", "--port", "eighty", "valid integer"),
    ("adapter", "--port", "70000", "less than or equal to 65535"),
    ("adapter", "ROLLBUS_ADAPTER_PING_INTERVAL", "soon", "valid number"),
    ("adapter", "--drain-timeout", "-1", "greater than or equal to 0"),
    ("adapter", "ROLLBUS_ADAPTER_OPEN_SESSIONS", "maybe", "boolean"),
    ("adapter", "--open-sessions", "perhaps", "boolean"),
    ("adapter", "--history-mode", "magic", "'canonical' or 'rerender'"),
    ("adapter", "--sglang-url", "localhost:30000", "match pattern"),
    ("adapter", "ROLLBUS_NAMESPACE", "a b", "match pattern"),
    ("adapter", "--bootstrap-servers", "", "at least 1 character"),
    ("adapter", "--outbox-capacity", "0", "greater than or equal to 1"),
    ("engine", "--policy", "greedy", "'sample' or 'scripted'"),
    ("engine", "ROLLBUS_ENGINE_CONTEXT_LENGTH", "1", "greater than or equal to 2"),
    ("engine", "SGLANG_RETURN_ORIGINAL_LOGPROB", "perhaps", "boolean"),
    ("replay", "ROLLBUS_REPLAY_CONNECT_TIMEOUT", "never", "valid number"),
    ("tail", "--connect-timeout", "0", "greater than 0"),
    ("topics", "--partitions", "0", "greater than or equal to 1"),
    ("topics", "ROLLBUS_TOPICS_REPLICATION_FACTOR", "two", "valid integer"),
    ("broker", "--port", "99999", "less than or equal to 65535"),
    ("broker", "ROLLBUS_BROKER_TIMEOUT", "-5", "greater than 0"),
]
POSITIONAL = {"replay": ["turns"], "tail": ["turns"], "topics": ["list"], "broker": ["status"]}


@pytest.mark.parametrize(("command", "where", "value", "expected"), BAD_VALUES)
def test_a_bad_value_is_one_line_naming_it_and_exit_2(command, where, value, expected, monkeypatch) -> None:
    """Before any port is bound, model built or broker called (a subprocess: nothing of it can leak)."""
    argv = [sys.executable, "-m", "rollbus", command]
    if where.startswith("--"):
        argv += [where, value]
    else:
        monkeypatch.setenv(where, value)
    argv += POSITIONAL.get(command, [])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"{where}={value!r}" in lines[0] and expected in lines[0]
