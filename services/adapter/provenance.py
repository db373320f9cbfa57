"""Ids we can recognise when a client echoes a turn back: tool call ids are a hash of (rollout, chain, turn,
index) and reasoning signatures an HMAC naming the turn, so a later request's history (or the bus, after a
restart) can be matched to the turn that produced it without trusting text. Every protocol carries them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Protocol

from rollbus.services.adapter.assistant import Reasoning, ToolCall

SIGNATURE_PREFIX = "rb1"


class ParsedCall(Protocol):
    name: str
    arguments: dict[str, Any]


class Parsed(Protocol):
    """What :func:`rollbus.services.adapter.parsing.parse_output` returns, as far as a turn needs it."""

    reasoning: str | None
    text: str
    tool_calls: list[ParsedCall]


@dataclass(frozen=True)
class TurnRef:
    rollout_id: str
    chain_id: str
    turn_index: int

    def key(self) -> str:
        return f"{self.rollout_id}/{self.chain_id}/{self.turn_index}"


def tool_use_id(ref: TurnRef, index: int) -> str:
    digest = hashlib.sha256(f"{ref.key()}/{index}".encode()).hexdigest()
    return f"toolu_{digest[:24]}"


def thinking_signature(secret: bytes, ref: TurnRef) -> str:
    """``rb1.<turn key, base64>.<hmac>``: names the turn and proves we wrote it."""
    key = ref.key().encode()
    mac = hmac.new(secret, key, hashlib.sha256).hexdigest()[:32]
    return f"{SIGNATURE_PREFIX}.{base64.urlsafe_b64encode(key).decode()}.{mac}"


def signed_turn(secret: bytes, signature: str) -> str | None:
    """The turn key a signature names, or None if we did not sign it."""
    parts = signature.split(".")
    if len(parts) != 3 or parts[0] != SIGNATURE_PREFIX:
        return None
    try:
        key = base64.urlsafe_b64decode(parts[1].encode())
    except ValueError:
        return None
    expected = hmac.new(secret, key, hashlib.sha256).hexdigest()[:32]
    return key.decode(errors="replace") if hmac.compare_digest(expected, parts[2]) else None


def signed_parts(
    parsed: Parsed, ref: TurnRef, secret: bytes
) -> tuple[Reasoning | None, str, tuple[ToolCall, ...]]:
    """The parsed output's reasoning (signed), text and tool calls (our ids), as the turn returns them."""
    reasoning = Reasoning(parsed.reasoning, thinking_signature(secret, ref)) if parsed.reasoning else None
    calls = tuple(
        ToolCall(tool_use_id(ref, i), call.name, dict(call.arguments))
        for i, call in enumerate(parsed.tool_calls)
    )
    return reasoning, parsed.text, calls
