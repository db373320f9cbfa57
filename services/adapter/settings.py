"""Adapter settings as one frozen value, so the app is built from data and bad values fail at start."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

HISTORY_MODES = ("canonical", "rerender")
MIN_SIGNING_KEY_BYTES = 16


@dataclass(frozen=True)
class AdapterSettings:
    sglang_url: str = "http://127.0.0.1:30000"
    tokenizer: str = "qwen3.6"
    context_length: int = 32768
    max_new_tokens: int = 8192
    history_mode: str = "canonical"
    tool_parser: str = "qwen3_coder"
    reasoning_parser: str = "qwen3"
    max_concurrency: int = 32
    body_limit: int = 32 * 1024 * 1024
    body_timeout: float = 60.0  # seconds a request body may take to arrive in full (408 after)
    admin_token: str | None = None
    open_sessions: bool = False
    policy_version: int = 0
    topic_namespace: str = ""  # publish to ``<namespace>.turns`` etc. (tests); "" is the real topics
    ping_interval: float = 10.0  # seconds without bytes before a ping; the CLI gives up after 180 s
    engine_timeout: float = 1800.0
    engine_api_key: str | None = field(default=None, repr=False)  # the engine's --api-key, if it has one
    outbox_capacity: int = 1000  # records waiting for the bus before new turns get 503
    outbox_capacity_bytes: int = 256 * 1024 * 1024  # the same bound, in encoded bytes
    publish_wait: float = 30.0  # seconds a turn waits for the bus's ack before answering anyway (queued)
    bus_request_timeout: float = 30.0  # the producer's own delivery timeout; it retries within it
    retry_after: float = 2.0  # seconds suggested to clients refused under overload or drain
    drain_timeout: float = 60.0
    max_chains_per_rollout: int = 64  # chains one rollout may open (agents, sub-agents, side calls, rewrites)
    restore_sessions: bool = True  # rebuild open rollouts from the bus at start (main.py; tests pass records)
    token_ttl: float = 7 * 24 * 3600.0  # seconds a session token stays valid
    session_idle_timeout: float = 3600.0  # seconds without a request before a session closes; 0: never
    state_dir: Path = Path(".rollbus")
    # HMAC key of thinking signatures: random per process unless given, so a restarted adapter (or
    # another replica) recognises the signatures of the history the CLI echoes only if they share it
    signing_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def __post_init__(self) -> None:
        if self.history_mode not in HISTORY_MODES:
            raise ValueError(f"history_mode must be one of {HISTORY_MODES}, not {self.history_mode!r}")
        for name in (
            "context_length",
            "max_new_tokens",
            "max_concurrency",
            "body_limit",
            "outbox_capacity",
            "outbox_capacity_bytes",
            "max_chains_per_rollout",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("ping_interval", "body_timeout", "bus_request_timeout", "token_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if not self.signing_key:
            raise ValueError("signing_key must not be empty")
        if len(self.signing_key) < MIN_SIGNING_KEY_BYTES:
            raise ValueError(
                f"signing_key must be at least {MIN_SIGNING_KEY_BYTES} bytes, not {len(self.signing_key)}"
            )
        if self.publish_wait < 0:
            raise ValueError(f"publish_wait must be 0 or positive, not {self.publish_wait}")
        if self.session_idle_timeout < 0:
            raise ValueError(
                f"session_idle_timeout must be 0 (never) or positive, not {self.session_idle_timeout}"
            )
