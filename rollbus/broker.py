"""The embedded broker moved beside the rest of the Kafka layer, to :mod:`rollbus.kafka.broker`; this
name re-exports it so imports written before keep working."""

from rollbus.kafka.broker import (
    DEFAULT_PORT,
    BrokerError,
    BrokerSettings,
    EmbeddedBroker,
    add_arguments,
    answers_metadata,
    cluster_id,
    free_port,
    pid_alive,
    port_is_open,
    run,
    start_port,
    wait_until_ready,
)

__all__ = [
    "DEFAULT_PORT", "BrokerError", "BrokerSettings", "EmbeddedBroker", "add_arguments", "answers_metadata",
    "cluster_id", "free_port", "pid_alive", "port_is_open", "run", "start_port", "wait_until_ready",
]  # fmt: skip
