"""The assistant turn as Anthropic content blocks, with ids we can recognise when the CLI echoes them.

tool_use ids are a hash of (rollout, chain, turn, index) and thinking signatures an HMAC naming the
turn, so a later request's history can be matched to the turn that produced it without trusting text.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Any, Protocol

SIGNATURE_PREFIX = "rb1"


class ToolCall(Protocol):
    name: str
    arguments: dict[str, Any]


class Parsed(Protocol):
    """What :func:`rollbus.parsing.parse_output` returns, as far as responses need it."""

    reasoning: str | None
    text: str
    tool_calls: list[Any]


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


def content_blocks(parsed: Parsed, ref: TurnRef, secret: bytes) -> list[dict[str, Any]]:
    """thinking, then text, then tool_use blocks, in the order the model wrote them."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append(
            {"type": "thinking", "thinking": parsed.reasoning, "signature": thinking_signature(secret, ref)}
        )
    if parsed.text:
        blocks.append({"type": "text", "text": parsed.text})
    for i, call in enumerate(parsed.tool_calls):
        blocks.append(
            {"type": "tool_use", "id": tool_use_id(ref, i), "name": call.name, "input": dict(call.arguments)}
        )
    return blocks


def stop_reason(finish_type: str, blocks: list[dict[str, Any]], matched: Any) -> tuple[str, str | None]:
    """Anthropic ``(stop_reason, stop_sequence)`` from the engine's finish reason and the parsed blocks."""
    if finish_type == "length":
        return "max_tokens", None
    if any(block["type"] == "tool_use" for block in blocks):
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def message_body(
    message_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    stop: tuple[str | None, str | None],
    usage: dict[str, int],
) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
