"""Is a Kafka broker there? One bounded probe and one message for the commands a person runs by hand.

aiokafka, left alone, answers an unreachable broker with a page of tracebacks, reconnect warnings every
few milliseconds and "Unclosed AIOKafkaConsumer" at exit. The hand-run commands (``replay``, ``tail``,
``topics``) instead probe first, within ``--connect-timeout`` seconds, and say in one line which address
could not be reached and what to do; aiokafka's own log is silenced for them (:func:`quiet_kafka_logs`).
"""

from __future__ import annotations

import asyncio
import logging

DEFAULT_CONNECT_TIMEOUT = 10.0


class BrokerUnreachable(RuntimeError):
    """No broker answered at the bootstrap address; the message says where and what to do."""

    def __init__(self, bootstrap_servers: str, timeout: float) -> None:
        super().__init__(
            f"no Kafka broker answers at {bootstrap_servers} (waited up to {timeout:g}s): start the embedded "
            "one with `rollbus broker start`, or point --bootstrap-servers (ROLLBUS_BOOTSTRAP_SERVERS) "
            "at yours"
        )
        self.bootstrap_servers = bootstrap_servers


def quiet_kafka_logs() -> None:
    """Keep aiokafka's connection chatter off a person's terminal: the commands report reachability
    themselves, once."""
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL + 1)


async def reachable(bootstrap_servers: str, timeout: float) -> bool:
    """True if a metadata request to ``bootstrap_servers`` names a broker within ``timeout`` seconds."""
    from aiokafka.errors import KafkaError

    from rollbus.kafka import clients

    timeout_ms = max(int(timeout * 1000), 1)
    try:
        async with clients.metadata_client(
            bootstrap_servers, client_id="rollbus-probe", request_timeout_ms=timeout_ms
        ) as client:
            await asyncio.wait_for(client.bootstrap(), timeout)
            return bool(client.cluster.brokers())
    except (KafkaError, OSError, TimeoutError, ValueError):
        return False


async def require_broker(bootstrap_servers: str, timeout: float) -> None:
    """Raise :class:`BrokerUnreachable` unless a broker answers within ``timeout`` seconds."""
    if not await reachable(bootstrap_servers, timeout):
        raise BrokerUnreachable(bootstrap_servers, timeout)
