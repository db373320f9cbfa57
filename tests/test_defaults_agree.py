"""Defaults that must agree do: a service's default address of another service is where that one listens by
default, and one thing has one option name in every service (the Kafka consumer group: --consumer-group)."""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

import pytest

from rollbus.cli import COMMANDS
from rollbus.settings import Settings


def settings_classes() -> dict[str, type[Settings]]:
    found: dict[str, type[Settings]] = {}
    for module_name, _ in COMMANDS.values():
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            declared = isinstance(value, type) and issubclass(value, Settings)
            if declared and value.__module__ != "rollbus.settings":
                found[value.__name__] = value
    return found


def default(cls: type[Settings], name: str) -> object:
    return cls.model_fields[name].default


def port_of(url: object) -> int | None:
    return urlsplit(str(url)).port


def test_callers_default_to_where_the_adapter_and_the_engine_listen() -> None:
    classes = settings_classes()
    adapter, engine = classes["AdapterSettings"], classes["EngineSettings"]
    assert port_of(default(adapter, "sglang_url")) == default(engine, "port")
    for caller in ("RunnerSettings", "GymRunnerSettings"):
        assert port_of(default(classes[caller], "adapter_url")) == default(adapter, "port"), caller


@pytest.mark.parametrize("name", sorted(settings_classes()))
def test_the_consumer_group_has_one_name(name: str) -> None:
    assert "group_id" not in settings_classes()[name].model_fields, f"{name} has --group-id"


def test_the_long_running_consumers_fetch_wait_is_one_setting_each() -> None:
    """The grader's and the runner's empty-fetch wait is their own setting (``--fetch-wait-ms``, default 2 s
    on the broker, not aiokafka's 0.5 s), read from the flag and the service's variable."""
    classes = settings_classes()
    for name, service in (("GraderSettings", "GRADER"), ("RunnerSettings", "SANDBOX_RUNNER")):
        cls = classes[name]
        assert default(cls, "fetch_wait_ms") == 2000, name
        assert cls.load({"fetch_wait_ms": "250"}).fetch_wait_ms == 250, name
        assert cls.env_var("fetch_wait_ms") == f"ROLLBUS_{service}_FETCH_WAIT_MS", name
        with pytest.raises(ValueError, match="fetch"):
            cls.load({"fetch_wait_ms": "-1"})


def test_the_runner_s_fetcher_looks_at_its_partitions_every_2_s_unless_woken() -> None:
    """``--consumer-timeout-ms``: the runner's tasks consumer takes it as aiokafka's ``consumer_timeout_ms``
    (default 200 ms there: five idle wake-ups a second), read from the flag and the runner's variable."""
    cls = settings_classes()["RunnerSettings"]
    assert default(cls, "consumer_timeout_ms") == 2000
    assert cls.env_var("consumer_timeout_ms") == "ROLLBUS_SANDBOX_RUNNER_CONSUMER_TIMEOUT_MS"
    assert cls.load({"consumer_timeout_ms": "200"}).consumer_timeout_ms == 200
    with pytest.raises(ValueError, match="consumer-timeout-ms"):
        cls.load({"consumer_timeout_ms": "0"})
