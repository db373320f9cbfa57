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
