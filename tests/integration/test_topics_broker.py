"""Topic creation and the start-up check against a real broker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from aiokafka.admin import NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from rollbus.kafka import clients
from rollbus.kafka.topics import TOPICS, TopicsError, check_topics, create_topics, topic_name
from tests.conftest import TEST_PARTITIONS, unique_namespace

pytestmark = pytest.mark.kafka


async def topic_config(bootstrap: str, topic: str) -> dict[str, str]:
    async with clients.admin(bootstrap, client_id="test-topics") as admin:
        [response] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    [(_, _, _, _, entries)] = response.resources
    return {entry[0]: entry[1] for entry in entries}


async def test_create_is_idempotent_and_applies_specs(kafka_bootstrap: str) -> None:
    namespace = unique_namespace()
    first = await create_topics(kafka_bootstrap, 4, namespace)
    again = await create_topics(kafka_bootstrap, 4, namespace)
    assert sorted(first) == sorted(topic_name(s.name, namespace) for s in TOPICS)
    assert again == []
    counts = await check_topics(kafka_bootstrap, namespace)
    assert counts == {s.name: 4 if s.rollout_keyed else 1 for s in TOPICS}
    turns = await topic_config(kafka_bootstrap, topic_name("turns", namespace))
    policy = await topic_config(kafka_bootstrap, topic_name("policy", namespace))
    assert turns["retention.ms"] == "-1" and turns["cleanup.policy"] == "delete"
    assert policy["cleanup.policy"] == "compact"


async def test_partition_count_mismatch_is_refused(kafka_bootstrap: str) -> None:
    namespace = unique_namespace()
    async with clients.admin(kafka_bootstrap, client_id="test-topics") as admin:
        # someone created "rewards" by hand with a different partition count
        await admin.create_topics([NewTopic(topic_name("rewards", namespace), TEST_PARTITIONS + 1, 1)])
    await create_topics(kafka_bootstrap, TEST_PARTITIONS, namespace)
    with pytest.raises(TopicsError, match=r"must share one partition count.*rewards=4"):
        await check_topics(kafka_bootstrap, namespace)

    env = {**os.environ, "ROLLBUS_BOOTSTRAP_SERVERS": kafka_bootstrap, "ROLLBUS_NAMESPACE": namespace}
    command = [sys.executable, "-m", "rollbus", "topics", "check"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1
    assert "rollout-keyed topics must share one partition count" in done.stderr


async def test_missing_topics_are_named(kafka_bootstrap: str) -> None:
    namespace = unique_namespace()
    with pytest.raises(TopicsError, match=rf"missing topics {namespace}\.tasks, .*rollbus topics create"):
        await check_topics(kafka_bootstrap, namespace)


async def test_a_refused_creation_names_the_topic_and_the_broker_error(kafka_bootstrap: str) -> None:
    namespace = unique_namespace()
    with pytest.raises(TopicsError, match=rf"could not create topics: {namespace}\.tasks error 37"):
        await create_topics(kafka_bootstrap, 0, namespace)
