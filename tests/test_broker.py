"""The embedded broker's parts that need no JVM: jar cache keys, rendered config, cluster ids, CLI."""

from __future__ import annotations

import argparse
import re
import socket
from pathlib import Path

import pytest

from rollbus.kafka.broker import BrokerSettings, EmbeddedBroker, add_arguments, cluster_id
from rollbus.kafka.runtime import BrokerError, adopt_archive, fetch, jars_dir, render


def test_jars_are_cached_by_pom_hash_and_fetch_is_a_no_op_once_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE", str(tmp_path))
    target = jars_dir()
    assert target.parent == tmp_path and re.fullmatch(r"kafka-[0-9a-f]{16}", target.name)
    target.mkdir()
    (target / ".complete").touch()
    monkeypatch.setenv("PATH", "")  # no mvn: a fetch that tried to run it would fail
    assert fetch() == target


def test_fetch_without_maven_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", "")
    with pytest.raises(BrokerError, match="Maven"):
        fetch()


def test_server_properties_render_for_a_single_kraft_node(tmp_path: Path) -> None:
    target = tmp_path / "server.properties"
    render("server.properties", target, port=19092, controller_port=19093, data_dir=tmp_path / "data")
    props = dict(
        line.split("=", 1) for line in target.read_text().splitlines() if line and not line.startswith("#")
    )
    assert props["process.roles"] == "broker,controller"
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert props["log.dirs"] == str(tmp_path / "data")
    assert props["transaction.state.log.replication.factor"] == "1"
    assert props["auto.create.topics.enable"] == "false"


def test_cluster_ids_look_like_kafkas() -> None:
    ids = {cluster_id() for _ in range(500)}
    assert len(ids) == 500
    assert all(re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]{21}", i) for i in ids)  # never led by "-"


def test_a_fresh_state_dir_has_no_running_broker(tmp_path: Path) -> None:
    fresh = EmbeddedBroker(tmp_path, port=19999)
    assert fresh.home == tmp_path.resolve() / "kafka"
    assert fresh.bootstrap_servers == "127.0.0.1:19999"
    assert not fresh.is_running() and fresh.pid() is None
    fresh.stop()  # stopping nothing is fine


def test_cli_port_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_BROKER_PORT", "19555")
    parser = argparse.ArgumentParser(prog="rollbus broker")
    add_arguments(parser)
    assert BrokerSettings.from_args(parser.parse_args(["status"])).port == 19555


def test_start_refuses_a_taken_port_before_launching_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = EmbeddedBroker(tmp_path, port=taken.getsockname()[1])
        with pytest.raises(BrokerError, match="already taken"):
            busy.start()
    assert not (tmp_path / "kafka" / "broker.json").exists()


@pytest.mark.parametrize(
    ("complete", "final_exists", "adopted"), [(True, False, True), (False, False, False), (True, True, False)]
)
def test_a_class_archive_is_adopted_only_after_a_clean_exit(
    tmp_path: Path, complete: bool, final_exists: bool, adopted: bool
) -> None:
    final = tmp_path / "kafka-abc.jsa"
    pending = tmp_path / "kafka-abc.jsa.123-456"
    pending.write_bytes(b"new archive")
    if final_exists:
        final.write_bytes(b"first archive")
    adopt_archive(str(pending), complete=complete)
    assert not pending.exists()
    assert final.exists() == (adopted or final_exists)
    if final_exists:
        assert final.read_bytes() == b"first archive"


def test_docker_path_builds_a_kraft_container_allowing_transactions(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the testcontainers path starts, decided without an engine (make test's second run starts it)."""
    from tests.conftest import broker_kind, kafka_container

    container = kafka_container("rollbus/kafka:4.1.1-0123456789ab", version="1.44")  # asks no engine
    assert container.kraft_enabled and container.image == "rollbus/kafka:4.1.1-0123456789ab"
    assert container.env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    assert container.env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == "1"
    monkeypatch.setenv("ROLLBUS_TEST_BROKER", "docker")
    assert broker_kind() == "docker"
    monkeypatch.setenv("ROLLBUS_TEST_BROKER", "podman")
    with pytest.raises(pytest.UsageError, match="expected one of docker, local, external"):
        broker_kind()
