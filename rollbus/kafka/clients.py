"""The one place rollbus builds Kafka clients: producers, consumers, admin clients and metadata probes.

Each takes the bus's address, a client id (the name the broker's logs and metrics show) and, for a
consumer, its group (None: no group, partitions assigned by hand and nothing committed). Consumers never
auto-commit: every rollbus reader commits what it finished itself, or nothing. Other options are
aiokafka's own, passed through.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient


def producer(bootstrap_servers: str, *, client_id: str, **options: Any) -> AIOKafkaProducer:
    return AIOKafkaProducer(bootstrap_servers=bootstrap_servers, client_id=client_id, **options)


def consumer(
    bootstrap_servers: str, *topics: str, client_id: str, consumer_group: str | None = None, **options: Any
) -> AIOKafkaConsumer:
    """A consumer of ``topics`` (none: assign partitions by hand) that commits only when told to."""
    return AIOKafkaConsumer(
        *topics, bootstrap_servers=bootstrap_servers, client_id=client_id, group_id=consumer_group,
        enable_auto_commit=False, **options,
    )  # fmt: skip


@contextlib.asynccontextmanager
async def started_consumer(
    bootstrap_servers: str, *topics: str, client_id: str, consumer_group: str | None = None, **options: Any
) -> AsyncIterator[AIOKafkaConsumer]:
    """:func:`consumer`, started, and stopped on leaving (also when starting failed half-way)."""
    client = consumer(
        bootstrap_servers, *topics, client_id=client_id, consumer_group=consumer_group, **options
    )
    try:
        await client.start()
        yield client
    finally:
        await client.stop()


@contextlib.asynccontextmanager
async def admin(bootstrap_servers: str, *, client_id: str) -> AsyncIterator[AIOKafkaAdminClient]:
    """A started admin client, closed on leaving."""
    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id=client_id)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def metadata_client(
    bootstrap_servers: str, *, client_id: str, request_timeout_ms: int
) -> AsyncIterator[AIOKafkaClient]:
    """A bare client for metadata requests only (is a broker there?), not bootstrapped; closed on leaving,
    quietly: a probe of an absent broker must not end in a second error."""
    client = AIOKafkaClient(
        bootstrap_servers=bootstrap_servers, client_id=client_id, request_timeout_ms=request_timeout_ms
    )
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            await client.close()
