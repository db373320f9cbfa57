"""The rollbus command: subcommands listed, flags documented, environment fallbacks honoured."""

import argparse
import importlib
import subprocess
import sys

import pytest

from rollbus.cli import COMMANDS, built, command_parser, main
from rollbus.config import add_option, env_name


def test_env_name_follows_the_flag() -> None:
    assert env_name("--bootstrap-servers") == "ROLLBUS_BOOTSTRAP_SERVERS"


def test_option_takes_environment_before_default(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_option(parser, "--max-turns", default=3, type=int, help="turns")
    assert parser.parse_args([]).max_turns == 3
    monkeypatch.setenv("ROLLBUS_MAX_TURNS", "7")
    parser = argparse.ArgumentParser()
    add_option(parser, "--max-turns", default=3, type=int, help="turns")
    assert parser.parse_args([]).max_turns == 7
    assert parser.parse_args(["--max-turns", "9"]).max_turns == 9
    assert "ROLLBUS_MAX_TURNS" in parser.format_help()


def test_bad_environment_value_fails_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_MAX_TURNS", "many")
    with pytest.raises(ValueError, match="ROLLBUS_MAX_TURNS='many'"):
        add_option(argparse.ArgumentParser(), "--max-turns", default=3, type=int, help="turns")


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


def test_stub_marker_follows_the_module_source(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A stage on the stub says NOT BUILT YET in `rollbus --help` and its own; the mark goes once the
    module stops using the stub, and a stage with no module at all says so instead of a traceback."""
    package = tmp_path / "fakestage"
    package.mkdir()
    (package / "__init__.py").write_text("")
    stub = "import argparse\nfrom services._stub import not_built_yet\n\n\ndef add_arguments(p):\n"
    stub += "    p.add_argument('--x', help='x of it')\n\n\n"
    stub += "def run(args):\n    return not_built_yet('f', 'w')\n"
    (package / "main.py").write_text(stub)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMANDS, "fake", ("fakestage.main", "does fake things"))
    monkeypatch.setitem(COMMANDS, "ghost", ("nosuchpackage.main", "does nothing yet"))
    assert not built("fakestage.main") and not built("nosuchpackage.main") and built("rollbus.replay")
    assert "NOT BUILT YET: does fake things" in help_of("fake", capsys)
    assert main(["fake"]) == 2 and "not built yet" in capsys.readouterr().err
    assert main(["ghost"]) == 2 and "not built yet (no nosuchpackage)" in capsys.readouterr().err
    (package / "main.py").write_text(stub.replace("return not_built_yet('f', 'w')", "return 0").replace(
        "from services._stub import not_built_yet\n", ""))  # fmt: skip
    assert built("fakestage.main")
    assert "NOT BUILT YET" not in help_of("fake", capsys)
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = " ".join(capsys.readouterr().out.split())
    assert "fake does fake things" in listing and "ghost NOT BUILT YET: does nothing yet" in listing


def test_unknown_subcommand_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["no-such-thing"])
    assert done.value.code == 2


def test_service_flags_read_variables_scoped_by_the_service(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two services with a --port each must not read each other's port from one shared environment."""
    from rollbus.config import add_common_options

    monkeypatch.setenv("ROLLBUS_ENGINE_PORT", "31000")
    monkeypatch.setenv("ROLLBUS_PORT", "1")
    monkeypatch.setenv("ROLLBUS_BOOTSTRAP_SERVERS", "kafka:9092")
    parsers = {name: argparse.ArgumentParser(prog=f"rollbus {name}") for name in ("engine", "adapter")}
    for parser in parsers.values():
        add_option(parser, "--port", default=8080, type=int, help="port")
        add_common_options(parser)
    engine, adapter = (parsers[name].parse_args([]) for name in ("engine", "adapter"))
    assert (engine.port, adapter.port) == (31000, 8080)
    assert engine.bootstrap_servers == adapter.bootstrap_servers == "kafka:9092"
    assert env_name("--sglang-url", "adapter") == "ROLLBUS_ADAPTER_SGLANG_URL"


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
