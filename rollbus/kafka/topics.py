"""The rollbus topics: their specs, and creating and checking them on a cluster.

Every rollout-keyed topic (tasks, turns, sessions, diffs, rewards, segments) has the *same* partition
count. With Kafka's default partitioner (murmur2 of the key) one rollout id then maps to the same
partition number on every topic, so a service joining turns, sessions and rewards of one rollout
(the segmenter) sees them all in one task, without a repartition step. A mismatch silently breaks
that join, so :func:`check_topics` refuses it and services call it at start-up.

Raw events are the source of truth and are kept forever (``retention.ms=-1``); ``policy`` is
compacted on its single key, so the latest policy version is always readable.

A *namespace* prefixes every name (``"t42.turns"``): tests and parallel demos get their own topics
on a shared broker without touching the real ones.

The command over these, ``rollbus topics``, is :mod:`rollbus.commands.topics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import NewTopic

from rollbus.events import EVENTS
from rollbus.kafka import clients
from rollbus.polling import WaitTimeout, wait_until_async

DEFAULT_PARTITIONS = 6  # enough for a few parallel segmenters/graders on one node; cheap on disk
MAX_EVENT_BYTES = 8 * 2**20  # turns carry whole prompts as token ids
DEAD_LETTER_MAX_BYTES = 16 * 2**20  # room for an oversized original plus its error


class TopicsError(RuntimeError):
    """Topics are missing or inconsistent on the cluster; the message says what to fix."""


@dataclass(frozen=True)
class TopicSpec:
    """One topic as rollbus wants it."""

    name: str
    event_type: str
    key: str  # what the Kafka key is, in words
    rollout_keyed: bool  # shares the common partition count
    partitions: int | None = None  # fixed count for topics not keyed by rollout id
    retention_ms: int = -1
    cleanup_policy: str = "delete"
    max_message_bytes: int = MAX_EVENT_BYTES

    def config(self) -> dict[str, str]:
        return {
            "retention.ms": str(self.retention_ms),
            "cleanup.policy": self.cleanup_policy,
            "max.message.bytes": str(self.max_message_bytes),
        }


def _spec(event_type: str, topic: str, key_field: str | None) -> TopicSpec:
    if key_field == "rollout_id":
        return TopicSpec(topic, event_type, "rollout id (raw UTF-8)", rollout_keyed=True)
    if event_type == "policy":
        key = 'the constant "policy"'
        return TopicSpec(topic, event_type, key, rollout_keyed=False, partitions=1, cleanup_policy="compact")
    if event_type == "train_step":  # one partition: the steps in their order
        return TopicSpec(topic, event_type, "none", rollout_keyed=False, partitions=1)
    key = "the original message's key"
    return TopicSpec(
        topic, event_type, key, rollout_keyed=False, partitions=1, max_message_bytes=DEAD_LETTER_MAX_BYTES
    )


TOPICS: tuple[TopicSpec, ...] = tuple(_spec(e.event_type, e.topic, e.key_field) for e in EVENTS)
DEAD_LETTERS = "dead-letters"


def topic_name(base: str, namespace: str = "") -> str:
    """``turns`` in namespace ``t42`` is ``t42.turns``; the empty namespace is the real topics."""
    return f"{namespace}.{base}" if namespace else base


def split_name(topic: str) -> tuple[str, str]:
    """``"t42.turns"`` -> ``("t42", "turns")``; inverse of :func:`topic_name` for rollbus topics."""
    namespace, _, base = topic.rpartition(".")
    return namespace, base


def spec_for(topic: str) -> TopicSpec:
    """The spec of a (possibly namespaced) rollbus topic; a clear error for anything else."""
    _, base = split_name(topic)
    for spec in TOPICS:
        if spec.name == base:
            return spec
    raise TopicsError(f"{topic!r} is not a rollbus topic; known: {', '.join(s.name for s in TOPICS)}")


def event_type_for(topic: str) -> str:
    return spec_for(topic).event_type


def dead_letters_for(topic: str) -> str:
    """The dead-letter topic in the same namespace as ``topic``."""
    return topic_name(DEAD_LETTERS, split_name(topic)[0])


def partitions_of(spec: TopicSpec, rollout_partitions: int) -> int:
    return rollout_partitions if spec.rollout_keyed else (spec.partitions or 1)


def mismatched(counts: dict[str, int]) -> str | None:
    """Why rollout-keyed partition counts (base name -> count) are inconsistent, or None if they agree."""
    keyed = {name: n for name, n in counts.items() if spec_for(name).rollout_keyed}
    if len(set(keyed.values())) <= 1:
        return None
    listing = ", ".join(f"{name}={n}" for name, n in sorted(keyed.items()))
    return (
        f"rollout-keyed topics must share one partition count, found {listing}; "
        "one rollout would land on different partitions of different topics"
    )


# --- against a cluster -------------------------------------------------------------------------


async def create_topics(
    bootstrap_servers: str,
    partitions: int = DEFAULT_PARTITIONS,
    namespace: str = "",
    replication_factor: int = 1,
) -> list[str]:
    """Create the missing rollbus topics; existing ones are left alone. Returns the names created."""
    async with clients.admin(bootstrap_servers, client_id="rollbus-topics") as admin:
        existing = set(await admin.list_topics())
        wanted = [
            NewTopic(
                topic_name(s.name, namespace),
                partitions_of(s, partitions),
                replication_factor,
                topic_configs=s.config(),
            )
            for s in TOPICS
            if topic_name(s.name, namespace) not in existing
        ]
        if wanted:
            response = await admin.create_topics(wanted)
            _raise_create_errors(response)
    await wait_visible(bootstrap_servers, [t.name for t in wanted])
    return [t.name for t in wanted]


async def wait_visible(bootstrap_servers: str, names: list[str], timeout: float = 30.0) -> None:
    """Wait until new topics show in metadata: the controller acknowledges a creation before every
    broker's metadata cache has it, and a service started right after must find its topics."""
    if not names:
        return

    async def visible() -> bool:
        return len(await describe(bootstrap_servers, names)) == len(names)

    try:
        await wait_until_async(visible, timeout=timeout, interval=0.1, what="new topics in metadata")
    except WaitTimeout:
        raise TopicsError(
            f"created topics did not appear in metadata within {timeout:.0f}s: {names}"
        ) from None


TOPIC_ALREADY_EXISTS = 36  # Kafka error code: another process created it first, which is fine


def _raise_create_errors(response: Any) -> None:
    """CreateTopics answers per topic with (name, error code[, message]); raise on real failures."""
    errors = [
        " ".join(str(part) for part in (name, "error", code, *rest) if part)
        for name, code, *rest in response.topic_errors
        if code not in (0, TOPIC_ALREADY_EXISTS)
    ]
    if errors:
        raise TopicsError("could not create topics: " + "; ".join(errors))


async def describe(bootstrap_servers: str, topics: list[str] | None = None) -> dict[str, int]:
    """Partition count of each topic that exists (all topics if ``topics`` is None)."""
    async with clients.admin(bootstrap_servers, client_id="rollbus-topics") as admin:
        present = set(await admin.list_topics())
        names = [t for t in (present if topics is None else topics) if t in present]
        described = await admin.describe_topics(names) if names else []
        return {t["topic"]: len(t["partitions"]) for t in described if t["error_code"] == 0}


async def partition_counts(bootstrap_servers: str, namespace: str = "") -> dict[str, int]:
    """Partition count of each rollbus topic present in ``namespace``, by base name."""
    counts = await describe(bootstrap_servers, [topic_name(s.name, namespace) for s in TOPICS])
    return {split_name(name)[1]: n for name, n in counts.items()}


async def check_topics(bootstrap_servers: str, namespace: str = "") -> dict[str, int]:
    """Raise :class:`TopicsError` unless every rollbus topic exists and rollout-keyed ones agree."""
    counts = await partition_counts(bootstrap_servers, namespace)
    missing = [topic_name(s.name, namespace) for s in TOPICS if s.name not in counts]
    if missing:
        raise TopicsError(f"missing topics {', '.join(missing)}: run `rollbus topics create`")
    problem = mismatched(counts)
    if problem:
        raise TopicsError(problem)
    return counts


async def create_fresh(bootstrap_servers: str, topic: str, partitions: int, like: str) -> None:
    """Create ``topic`` configured like the rollbus topic ``like``, for data derived again from the log
    (``rollbus rebuild``, ``rollbus regrade``); an existing topic is accepted only if it is empty, so two
    derivations never mix in one topic."""
    existing = await describe(bootstrap_servers, [topic])
    if topic in existing:
        tps = [TopicPartition(topic, p) for p in range(existing[topic])]
        async with clients.started_consumer(bootstrap_servers, client_id="rollbus-topics") as consumer:
            ends, starts = await consumer.end_offsets(tps), await consumer.beginning_offsets(tps)
        if any(ends[tp] > starts[tp] for tp in tps):
            raise TopicsError(f"{topic} already holds messages: write into a fresh topic")
        return
    async with clients.admin(bootstrap_servers, client_id="rollbus-topics") as admin:
        _raise_create_errors(
            await admin.create_topics([NewTopic(topic, partitions, 1, topic_configs=spec_for(like).config())])
        )
    await wait_visible(bootstrap_servers, [topic])
