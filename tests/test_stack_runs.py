"""Which run a stack is: a demo is its own run unless it asks to continue one; settings say which broker."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from rollbus.demo_runs import (
    NoEarlierRun,
    checkpoint_version,
    last_demo,
    new_demo_namespace,
    record_demo,
    run_line,
)
from rollbus.services.stack.demo import DemoSettings
from rollbus.services.stack.up import StackSettings
from rollbus.settings import SettingsError


def test_a_new_demo_namespace_is_a_valid_unique_topic_prefix() -> None:
    moment = datetime(2026, 11, 26, 10, 35, 12, tzinfo=UTC)
    names = {new_demo_namespace(moment) for _ in range(50)}
    assert len(names) > 40  # two demos started in the same second still differ
    assert all(re.fullmatch(r"demo-20261126-103512-[0-9a-f]{4}", name) for name in names)


def test_resume_is_the_newest_recorded_run_and_an_error_when_there_is_none(tmp_path: Path) -> None:
    with pytest.raises(NoEarlierRun, match="no earlier demo run"):
        last_demo(tmp_path)
    record_demo(tmp_path, "demo-a")
    record_demo(tmp_path, "demo-b")
    assert last_demo(tmp_path) == "demo-b"


def test_checkpoint_version_is_the_newest_of_the_namespace(tmp_path: Path) -> None:
    assert checkpoint_version(tmp_path, "demo-a") is None
    for name in ("v00000001", "v00000002", ".v00000003.tmp", "metrics.jsonl"):
        (tmp_path / "trainer" / "demo-a" / name).mkdir(parents=True)
    (tmp_path / "trainer" / "default" / "v00000009").mkdir(parents=True)
    assert checkpoint_version(tmp_path, "demo-a") == 2 and checkpoint_version(tmp_path, "") == 9


def test_the_run_line_says_new_or_what_it_continues() -> None:
    assert run_line("demo-a", 9, 9, None) == "new run: demo-a.* created"
    continuing = run_line("", 0, 9, 2)
    assert continuing.startswith("continuing the run in the un-namespaced topics")
    assert "9 of 9 topics already there" in continuing and "trainer checkpoint v2" in continuing


def given(cls: type, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **values: object) -> object:
    monkeypatch.delenv("ROLLBUS_BOOTSTRAP_SERVERS", raising=False)
    return cls.load({"state_dir": tmp_path, **values})


def test_a_bootstrap_address_given_means_no_embedded_broker(monkeypatch, tmp_path: Path) -> None:
    assert given(StackSettings, monkeypatch, tmp_path).starts_broker()
    assert not given(StackSettings, monkeypatch, tmp_path, bootstrap_servers="kafka:9092").starts_broker()
    assert not given(StackSettings, monkeypatch, tmp_path, embedded_broker="false").starts_broker()
    monkeypatch.setenv("ROLLBUS_BOOTSTRAP_SERVERS", "kafka:9092")
    settings = StackSettings.load({"state_dir": tmp_path})
    assert settings.bootstrap_servers == "kafka:9092" and not settings.starts_broker()
    with pytest.raises(SettingsError, match="name two brokers"):
        StackSettings.load({"state_dir": tmp_path, "embedded_broker": "true"})


def test_a_broker_recorded_in_the_state_dir_is_not_an_address_given(monkeypatch, tmp_path: Path) -> None:
    (tmp_path / "kafka").mkdir()
    (tmp_path / "kafka" / "broker.json").write_text('{"port": 41234}')
    settings = given(StackSettings, monkeypatch, tmp_path)
    assert settings.bootstrap_servers == "127.0.0.1:41234" and settings.starts_broker()


def test_each_demo_is_a_new_run_unless_told_to_continue(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ROLLBUS_NAMESPACE", raising=False)
    first, _ = given(DemoSettings, monkeypatch, tmp_path).run_namespace()
    second, how = given(DemoSettings, monkeypatch, tmp_path).run_namespace()
    assert first != second and first.startswith("demo-") and how == "a new run"
    with pytest.raises(NoEarlierRun):
        given(DemoSettings, monkeypatch, tmp_path, resume="true").run_namespace()
    record_demo(tmp_path / "up", second)
    assert given(DemoSettings, monkeypatch, tmp_path, resume="true").run_namespace()[0] == second
    assert given(DemoSettings, monkeypatch, tmp_path, namespace="mine").run_namespace()[0] == "mine"
    monkeypatch.setenv("ROLLBUS_NAMESPACE", "theirs")
    assert DemoSettings.load({"state_dir": tmp_path}).run_namespace()[0] == "theirs"
    with pytest.raises(SettingsError, match="give one"):
        DemoSettings.load({"state_dir": tmp_path, "resume": "true"})
