"""Adapter settings: the only declaration of each option (type, default, validation, help, ``--flag`` and
``ROLLBUS_ADAPTER_*`` variable), one frozen value the app is built from, so bad values fail at start."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from rollbus.policy_model import DEFAULT_TOKENIZER
from rollbus.settings import ADAPTER_PORT, ENGINE_URL, BusSettings

HISTORY_MODES = ("canonical", "rerender")
MIN_SIGNING_KEY_BYTES = 16


class AdapterSettings(BusSettings):
    """Settings of ``rollbus adapter`` (flags ``--x-y``, variables ``ROLLBUS_ADAPTER_X_Y``)."""

    model_config = BusSettings.scoped("adapter")

    host: str = Field("127.0.0.1", min_length=1, description="address to listen on")
    port: int = Field(ADAPTER_PORT, ge=0, le=65535, description="port to listen on")
    sglang_url: str = Field(
        ENGINE_URL, pattern=r"^https?://", description="SGLang (or rollbus engine) base URL"
    )
    engine_api_key: str | None = Field(
        None, repr=False, description="the engine's --api-key, sent as a bearer token (prefer the variable)"
    )
    tokenizer: str = Field(
        DEFAULT_TOKENIZER, min_length=1, description="built-in tokenizer name or directory"
    )
    context_length: int = Field(
        32768, ge=1, description="model context in tokens; longer prompts get 'prompt is too long'"
    )
    max_new_tokens: int = Field(8192, ge=1, description="cap on sampled tokens per turn")
    routed_experts: bool = Field(
        False, description="the served model is an MoE trained with routing replay: ask /generate for each "
        "turn's routed experts (SGLang needs --enable-return-routed-experts) and record them"
    )
    routed_experts_dir: Path | None = Field(
        None, description="where recorded routed experts are stored (the trainer reads them there); unset: "
        "<state-dir>/routed-experts"
    )
    top_logprobs: int = Field(
        0, ge=0, le=1024, description="ask /generate for each sampled token's top-k alternatives (SGLang's "
        "top_logprobs_num) and record them on the turn (output_top_logprobs); 0: none, the turn as before"
    )
    history_mode: Literal["canonical", "rerender"] = Field(
        "canonical", description="canonical: append-only token history; rerender: render every prompt whole"
    )
    tool_parser: str = Field("qwen3_coder", description="SGLang tool-call parser")
    reasoning_parser: str = Field("qwen3", description="SGLang reasoning parser ('' for none)")
    max_concurrency: int = Field(32, ge=1, description="turns generating at once; more get 529 + retry-after")
    body_limit: int = Field(32 * 1024 * 1024, ge=1, description="largest request body in bytes (413 above)")
    admin_body_limit: int = Field(64 * 1024, ge=1, description="largest /admin request body in bytes")
    body_timeout: float = Field(
        60.0, gt=0, description="seconds a request body may take to arrive in full (408 after)"
    )
    admin_token: str | None = Field(
        None, repr=False, description="bearer token of the /admin API (off if unset)"
    )
    open_sessions: bool = Field(False, description="dev: accept any session token, as the rollout id itself")
    policy_version: int = Field(0, ge=0, description="policy version recorded when the engine reports none")
    ping_interval: float = Field(
        10.0,
        gt=0,
        description="seconds between SSE pings while a turn generates (the CLI gives up after 180)",
    )
    engine_timeout: float = Field(1800.0, gt=0, description="seconds one engine call may take")
    engine_connect_timeout: float = Field(10.0, gt=0, description="seconds to connect to the engine")
    engine_keepalive: float = Field(
        2.0, gt=0, description="seconds an idle engine connection is kept; below the engine server's own "
        "keep-alive (uvicorn's: 5 s), or a request can go out on a connection the engine is closing",
    )
    abort_timeout: float = Field(5.0, gt=0, description="seconds an abort sent to the engine may take")
    outbox_capacity: int = Field(
        1000, ge=1, description="records that may wait for the bus before new turns get 529"
    )
    outbox_capacity_bytes: int = Field(
        256 * 1024 * 1024, ge=1, description="encoded bytes that may wait for the bus before turns get 529"
    )
    publish_wait: float = Field(
        30.0, ge=0, description="seconds a turn waits for the bus's ack before answering (it stays queued)"
    )
    bus_request_timeout: float = Field(
        30.0, gt=0, description="seconds the producer retries one delivery before the outbox retries it"
    )
    bus_retry_interval: float = Field(
        1.0, gt=0, description="seconds between publish retries while the bus is away"
    )
    retry_after: float = Field(
        2.0, gt=0, description="seconds suggested (retry-after) to clients refused under overload or drain"
    )
    drain_timeout: float = Field(
        60.0, ge=0, description="seconds a stop waits for turns in flight and the bus backlog"
    )
    max_chains_per_rollout: int = Field(
        64, ge=1, description="chains one rollout may open (main, sub-agents, side, rewrites); more get 400"
    )
    token_ttl: float = Field(7 * 24 * 3600.0, gt=0, description="seconds a session token stays valid")
    restore_sessions: bool = Field(
        True, description="rebuild open rollouts from the bus at start: agents carry on across a restart"
    )
    session_idle_timeout: float = Field(
        3600.0, ge=0, description="seconds without a request after which a session closes (0: never)"
    )
    # HMAC key of thinking signatures: random per process unless given, so a restarted adapter (or
    # another replica) recognises the signatures of the history the CLI echoes only if they share it
    signing_key: bytes = Field(
        default_factory=lambda: secrets.token_bytes(32),
        repr=False,
        description=f"HMAC key of thinking signatures, at least {MIN_SIGNING_KEY_BYTES} bytes; replicas and "
        "restarts sharing it recognise each other's signatures (unset: random per process; prefer the "
        "variable, flags show in ps)",
    )

    @field_validator("signing_key")
    @classmethod
    def _long_enough(cls, key: bytes) -> bytes:
        if not key:
            raise ValueError("signing_key must not be empty")
        if len(key) < MIN_SIGNING_KEY_BYTES:
            raise ValueError(f"signing_key must be at least {MIN_SIGNING_KEY_BYTES} bytes, not {len(key)}")
        return key

    def routes_dir(self) -> Path:
        from rollbus.routed_experts import STORE_DIR

        return self.routed_experts_dir or self.state_dir / STORE_DIR

    @property
    def topic_namespace(self) -> str:
        """Publish to ``<namespace>.turns`` etc. (tests); "" is the real topics."""
        return self.namespace
