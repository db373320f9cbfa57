"""The settings pattern every service copies: one declaration per option, bad values named at start-up."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field, SecretStr

from rollbus.settings import BusSettings, SettingsError


class Example(BusSettings):
    model_config = BusSettings.scoped("example-svc")
    grade_timeout: float = Field(600.0, gt=0, description="seconds one grade may take")
    workers: int = Field(2, ge=1, description="workers")
    mode: Literal["fast", "safe"] = Field("safe", description="how to run")
    enabled: bool = Field(False, description="a switch")
    api_key: SecretStr | None = Field(None, description="a secret")
    out: Path = Field(Path("/var/lib/x"), description="where to write")


def parse(argv: list[str]) -> Example:
    parser = argparse.ArgumentParser(prog="rollbus example-svc")
    Example.add_arguments(parser)
    return Example.from_args(parser.parse_args(argv))


def help_text() -> str:
    parser = argparse.ArgumentParser(prog="rollbus example-svc")
    Example.add_arguments(parser)
    return " ".join(parser.format_help().split())


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("ROLLBUS_BOOTSTRAP_SERVERS", "ROLLBUS_NAMESPACE", "ROLLBUS_STATE_DIR"):
        monkeypatch.delenv(name, raising=False)


def test_flag_beats_variable_beats_default(monkeypatch):
    assert parse([]).workers == 2
    monkeypatch.setenv("ROLLBUS_EXAMPLE_SVC_WORKERS", "5")
    assert parse([]).workers == 5
    assert parse(["--workers", "7"]).workers == 7


def test_shared_options_read_unscoped_variables(monkeypatch):
    monkeypatch.setenv("ROLLBUS_BOOTSTRAP_SERVERS", "10.0.0.1:9093")
    monkeypatch.setenv("ROLLBUS_EXAMPLE_SVC_BOOTSTRAP_SERVERS", "ignored:1")
    assert parse([]).bootstrap_servers == "10.0.0.1:9093"


@pytest.mark.parametrize(
    ("argv", "env", "named", "value"),
    [
        (["--grade-timeout", "abc"], {}, "--grade-timeout", "'abc'"),
        ([], {"ROLLBUS_EXAMPLE_SVC_GRADE_TIMEOUT": "-1"}, "ROLLBUS_EXAMPLE_SVC_GRADE_TIMEOUT", "'-1'"),
        (["--workers", "1.5"], {}, "--workers", "'1.5'"),
        ([], {"ROLLBUS_EXAMPLE_SVC_WORKERS": "0"}, "ROLLBUS_EXAMPLE_SVC_WORKERS", "'0'"),
        (["--mode", "turbo"], {}, "--mode", "'turbo'"),
        (["--enabled", "maybe"], {}, "--enabled", "'maybe'"),
        ([], {"ROLLBUS_EXAMPLE_SVC_ENABLED": "maybe"}, "ROLLBUS_EXAMPLE_SVC_ENABLED", "'maybe'"),
        ([], {"ROLLBUS_NAMESPACE": "two words"}, "ROLLBUS_NAMESPACE", "'two words'"),
        (["--bootstrap-servers", ""], {}, "--bootstrap-servers", "''"),
    ],
)
def test_a_bad_value_is_one_line_naming_its_source_and_value(monkeypatch, argv, env, named, value):
    for key, raw in env.items():
        monkeypatch.setenv(key, raw)
    with pytest.raises(SettingsError) as caught:
        parse(argv)
    message = str(caught.value)
    assert message.startswith(f"{named}={value}: ")
    assert "\n" not in message


def test_a_secret_is_never_echoed(monkeypatch):
    assert parse(["--api-key", "s3cr3t"]).api_key.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(parse(["--api-key", "s3cr3t"]))


def test_booleans_take_words_and_a_bare_flag():
    assert parse(["--enabled"]).enabled is True
    assert parse(["--enabled", "off"]).enabled is False


def test_help_lists_every_option_with_its_variable_and_a_typed_default():
    text = help_text()
    for name in Example.model_fields:
        assert Example.flag(name) in text
        assert Example.env_var(name) in text
    assert "default /var/lib/x" in text and "PosixPath" not in text
    assert "default false" in text and "(one of: fast, safe)" in text
    assert "default unset" in text


def test_cli_turns_a_bad_value_into_exit_2_without_traceback(monkeypatch, capsys):
    from rollbus import cli

    monkeypatch.setitem(cli.COMMANDS, "example-svc", (__name__, "an example"))
    with pytest.raises(SystemExit) as caught:
        cli.main(["example-svc", "--workers", "zero"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollbus example-svc: error: --workers='zero': ")
    assert "Traceback" not in err


add_arguments = Example.add_arguments


def run(args: argparse.Namespace) -> int:
    Example.from_args(args)
    return 0
