"""``POST /v1/messages``: the Anthropic Messages API the Claude Code CLI talks to, as one wire protocol.

The request is validated strictly (:mod:`rollbus.services.adapter.anthropic`) and translated to chat-template
messages (:mod:`rollbus.services.adapter.translate`); a turn is rendered as content blocks (thinking, text,
tool_use, in the order written), streamed as :mod:`rollbus.services.adapter.sse` frames. Which agent sent it:
the CLI's ``x-claude-code-agent-id``, else its history and system prompt
(:func:`rollbus.services.adapter.attribution.claude_code`); a main request answering an ``Agent`` call
completes the sub-agents that answered. Errors are ``{"type": "error", "error": {"type", "message"}}`` with
the retry hints the CLI obeys (:mod:`rollbus.services.adapter.errors`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rollbus.services.adapter import sse
from rollbus.services.adapter.anthropic import MessagesRequest, parse_messages_request
from rollbus.services.adapter.assistant import AssistantTurn, Reasoning, Text, ToolCall
from rollbus.services.adapter.attribution import answers_agent_call, claude_code
from rollbus.services.adapter.errors import ApiError
from rollbus.services.adapter.sessions import CLAUDE_CODE, Agent, Session
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.translate import to_chat
from rollbus.services.adapter.turn import Done, Ping, Started, TurnEvent, TurnInput
from rollbus.services.adapter.wire import Call, WireProtocol, shape

AGENT_HEADER = "x-claude-code-agent-id"


def content_blocks(turn: AssistantTurn) -> list[dict[str, Any]]:
    """The turn's parts as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    for part in turn.parts():
        if isinstance(part, Reasoning):
            blocks.append({"type": "thinking", "thinking": part.text, "signature": part.signature})
        elif isinstance(part, Text):
            blocks.append({"type": "text", "text": part.text})
        elif isinstance(part, ToolCall):
            blocks.append({"type": "tool_use", "id": part.id, "name": part.name, "input": part.arguments})
    return blocks


def message_body(turn: AssistantTurn) -> dict[str, Any]:
    """The turn as an Anthropic ``message`` (before generation: no blocks, no stop reason)."""
    return {
        "id": f"msg_{turn.id}",
        "type": "message",
        "role": "assistant",
        "model": turn.model,
        "content": content_blocks(turn),
        "stop_reason": turn.stop_reason,
        "stop_sequence": turn.stop_sequence,
        "usage": {
            "input_tokens": turn.input_tokens,
            "output_tokens": turn.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def error_response(err: ApiError) -> JSONResponse:
    """Anthropic's error shape, with the retry hints."""
    body = {"type": "error", "error": {"type": err.error_type, "message": err.message}}
    return JSONResponse(body, status_code=err.status, headers=err.headers())


class Messages(WireProtocol[MessagesRequest]):
    path = "/v1/messages"
    harness = CLAUDE_CODE

    def parse(self, body: bytes, settings: AdapterSettings) -> Call[MessagesRequest]:
        request = parse_messages_request(body)
        chat = to_chat(request.system, request.messages, request.tools)
        turn = TurnInput(chat, request.model, request.max_tokens, request.sampling(), CLAUDE_CODE)
        return Call(request, turn, request.stream)

    def agent(self, session: Session, call: Call[MessagesRequest], request: Request) -> Agent:
        return claude_code(session, shape(call.turn.chat, request, request.headers.get(AGENT_HEADER)))

    def finished_subagents(self, session: Session, call: Call[MessagesRequest]) -> list[Agent]:
        return session.finished_subagents() if answers_agent_call(call.turn.chat.messages) else []

    def body(self, call: Call[MessagesRequest], turn: AssistantTurn) -> dict[str, Any]:
        return message_body(turn)

    async def events(
        self,
        call: Call[MessagesRequest],
        agent: Agent,
        events: AsyncIterator[TurnEvent],
        started: Started,
    ) -> AsyncIterator[bytes]:
        yield sse.message_start(message_body(started.turn))
        try:
            async for item in events:
                if isinstance(item, Ping):
                    yield sse.ping()
                elif isinstance(item, Done):
                    message = message_body(item.turn)
                    # one write for the whole answer: each chunk is a trip through the ASGI stack and a
                    # socket write, and the answer is ~10 events; the bytes on the wire are the same
                    yield b"".join([*sse.content_events(message["content"]), *sse.message_end(message)])
        except ApiError as err:  # the status line is gone: the error travels as an event
            yield sse.error(err)

    def error(self, err: ApiError) -> Response:
        return error_response(err)
