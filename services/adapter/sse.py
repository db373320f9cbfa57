"""Server-sent events in the order the Anthropic streaming API uses.

message_start -> (content_block_start, content_block_delta..., content_block_stop) per block ->
message_delta -> message_stop; ``ping`` may come anywhere; ``error`` replaces the rest of the stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from rollbus.services.adapter.errors import ApiError


def event(name: str, data: dict[str, Any]) -> bytes:
    payload = json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


def ping() -> bytes:
    return event("ping", {})


def message_start(message: dict[str, Any]) -> bytes:
    """The message envelope before any content: no blocks, no stop reason yet."""
    head = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    return event("message_start", {"message": head})


def content_events(blocks: list[dict[str, Any]]) -> Iterator[bytes]:
    for index, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            yield event(
                "content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}}
            )
            yield _delta(index, {"type": "text_delta", "text": block["text"]})
        elif kind == "thinking":
            start: dict[str, Any] = {"type": "thinking", "thinking": "", "signature": ""}
            yield event("content_block_start", {"index": index, "content_block": start})
            yield _delta(index, {"type": "thinking_delta", "thinking": block["thinking"]})
            yield _delta(index, {"type": "signature_delta", "signature": block["signature"]})
        elif kind == "tool_use":
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            yield event("content_block_start", {"index": index, "content_block": start})
            partial = json.dumps(block["input"], ensure_ascii=False, separators=(",", ":"))
            yield _delta(index, {"type": "input_json_delta", "partial_json": partial})
        else:
            raise ValueError(f"cannot stream a {kind!r} block")
        yield event("content_block_stop", {"index": index})


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return event("content_block_delta", {"index": index, "delta": delta})


def message_end(message: dict[str, Any]) -> Iterator[bytes]:
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    yield event("message_delta", {"delta": delta, "usage": message["usage"]})
    yield event("message_stop", {})


def error(err: ApiError) -> bytes:
    return event("error", {"error": {"type": err.error_type, "message": err.message}})
