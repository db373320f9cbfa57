"""Services refuse to start on topics where a rollout's events could not meet in one partition."""

import os
import subprocess
import sys

import pytest
from aiokafka.admin import NewTopic

from rollbus.kafka import clients
from rollbus.kafka.topics import create_topics, topic_name
from tests.conftest import TEST_PARTITIONS, unique_namespace


def start_adapter(bootstrap: str, namespace: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ROLLBUS_BOOTSTRAP_SERVERS": bootstrap, "ROLLBUS_NAMESPACE": namespace}
    command = [sys.executable, "-m", "rollbus.services.adapter", "--port", "0"]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("service", [["sandbox-runner"], ["trainer"]])
def test_consumers_refuse_missing_topics_naming_them(kafka_bootstrap: str, service: list[str]) -> None:
    namespace = unique_namespace()
    env = {**os.environ, "ROLLBUS_BOOTSTRAP_SERVERS": kafka_bootstrap, "ROLLBUS_NAMESPACE": namespace}
    command = [sys.executable, "-m", "rollbus", *service]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"missing topics {namespace}.tasks" in done.stderr and "rollbus topics create" in done.stderr


def test_adapter_refuses_missing_topics(kafka_bootstrap: str) -> None:
    namespace = unique_namespace()
    done = start_adapter(kafka_bootstrap, namespace)
    assert done.returncode == 1
    assert f"missing topics {namespace}.tasks" in done.stderr and "rollbus topics create" in done.stderr


async def test_adapter_refuses_mismatched_partition_counts(kafka_bootstrap: str) -> None:
    namespace = unique_namespace()
    async with clients.admin(kafka_bootstrap, client_id="test-topics") as admin:
        await admin.create_topics([NewTopic(topic_name("turns", namespace), TEST_PARTITIONS + 1, 1)])
    await create_topics(kafka_bootstrap, TEST_PARTITIONS, namespace)
    done = start_adapter(kafka_bootstrap, namespace)
    assert done.returncode == 1
    assert "must share one partition count" in done.stderr
