"""A tiny recording Anthropic-compatible server that plays scripted replies, for testing the real CLI.

Only what the CLI needs: ``HEAD /`` and streaming ``POST /v1/messages``. Every request is recorded; each
``/v1/messages`` call consumes the next scripted reply. When the script runs out it answers a non-retried
400, so a CLI that asks for more fails loudly.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True)
class Reply:
    """One assistant message: Anthropic content blocks (``text`` / ``tool_use``) and why it stopped."""

    blocks: list[dict[str, Any]]
    stop_reason: str


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def tool_use(tool_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": name, "input": arguments}


def message_events(reply: Reply, *, model: str, message_id: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The SSE events of one streamed message, in the order the Messages API sends them."""
    yield (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1},
            },
        },
    )
    for index, block in enumerate(reply.blocks):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": start}
        yield "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "usage": {"output_tokens": 1},
            "delta": {"stop_reason": reply.stop_reason, "stop_sequence": None},
        },
    )
    yield "message_stop", {"type": "message_stop"}


def error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def sse(events: Iterator[tuple[str, dict[str, Any]]]) -> Iterator[str]:
    for event, data in events:
        yield f"event: {event}\ndata: {json.dumps(data)}\n\n"


@dataclass
class FakeAnthropic:
    """Serves ``replies`` on a free loopback port inside ``async with``; ``requests`` records the traffic."""

    replies: list[Reply]
    requests: list[Recorded] = field(default_factory=list)
    url: str = ""

    async def __aenter__(self) -> FakeAnthropic:
        app = Starlette(routes=[Route("/{path:path}", self._dispatch, methods=["GET", "HEAD", "POST"])])
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        )
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why the server could not start
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.should_exit = True
        await self._task

    def message_requests(self) -> list[Recorded]:
        return [r for r in self.requests if r.method == "POST" and r.path.endswith("/v1/messages")]

    async def _record(self, request: Request) -> Recorded:
        raw = await request.body()
        recorded = Recorded(
            request.method, request.url.path, dict(request.headers), json.loads(raw) if raw else None
        )
        self.requests.append(recorded)
        return recorded

    async def _dispatch(self, request: Request) -> Response:
        """Any path prefix works, as with a real ``ANTHROPIC_BASE_URL``."""
        recorded = await self._record(request)
        if request.method == "POST" and recorded.path.endswith("/v1/messages"):
            return self._messages(recorded)
        if request.method in ("GET", "HEAD") and "/v1/" not in recorded.path:
            return Response(status_code=200)
        return error(404, "not_found_error", f"the fake does not serve {request.method} {recorded.path}")

    def _messages(self, recorded: Recorded) -> Response:
        served = len(self.message_requests()) - 1
        if served >= len(self.replies):
            return error(400, "invalid_request_error", f"fake script exhausted after {served} replies")
        if not (recorded.body or {}).get("stream"):
            return error(400, "invalid_request_error", "the fake serves streaming requests only")
        model = recorded.body["model"]
        events = message_events(self.replies[served], model=model, message_id=f"msg_{served}")
        return StreamingResponse(sse(events), media_type="text/event-stream")
