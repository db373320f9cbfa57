"""The rollbus command: subcommands listed, flags documented, environment fallbacks honoured."""

import argparse
import subprocess
import sys

import pytest

from rollbus.cli import COMMANDS, main
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


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_documents_its_flags(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([name, "--help"])
    assert done.value.code == 0
    assert f"rollbus {name}" in capsys.readouterr().out


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
