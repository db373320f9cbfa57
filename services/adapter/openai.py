"""``POST /v1/chat/completions``: the OpenAI Chat Completions API as one wire protocol over the turn core.

Any OpenAI client can use it (``base_url=<adapter>/v1``, ``api_key=<session token>``); the gym runner does.
A request is translated to the same chat messages the Anthropic route produces and runs through
:func:`rollbus.services.adapter.turn.run_turn`, so its turn is planned on the rollout's canonical history,
token recorded and published exactly like a Claude Code turn (same session tokens, same ``turns``/``sessions``
events). All requests of one session token are one conversation: the rollout's ``main`` agent, tools or not
(the Anthropic route's side-call and sub-agent routing is for the CLI's traffic, not needed here).

Supported: ``messages`` (system/developer first, user, assistant with ``tool_calls`` and
``reasoning_content`` echoed back, tool), ``tools`` (function tools), ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``stream`` (chunks, ``data: [DONE]``),
``n`` = 1. Others (``tool_choice``, ``seed``, ``logprobs``, ...) are accepted and ignored. Errors use OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}`` with the same statuses and retry headers as the
Anthropic route (400 ``prompt is too long`` when the context is full; 529/503 with ``retry-after``).
Response extension: ``choices[0].message.reasoning_content`` (as SGLang and vLLM name it).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse, Response

from rollbus.services.adapter.assistant import AssistantTurn
from rollbus.services.adapter.bodies import check_json, decode_json
from rollbus.services.adapter.errors import ApiError, invalid_request
from rollbus.services.adapter.sessions import GYM, Agent
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.translate import ChatPrompt
from rollbus.services.adapter.turn import Done, Ping, Started, TurnEvent, TurnInput
from rollbus.services.adapter.wire import Call, WireProtocol

_MODEL = ConfigDict(extra="ignore", frozen=True)
FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


class TextPart(BaseModel):
    model_config = _MODEL
    type: Literal["text"]
    text: str


class Function(BaseModel):
    model_config = _MODEL
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = _MODEL
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: Function


Content = str | list[Annotated[TextPart, Field(discriminator="type")]] | None


class ChatMessage(BaseModel):
    model_config = _MODEL
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    model_config = _MODEL
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(BaseModel):
    model_config = _MODEL
    type: Literal["function"]
    function: FunctionSpec


class ChatRequest(BaseModel):
    model_config = _MODEL
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1

    def sampling(self) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        given = {"temperature": self.temperature, "top_p": self.top_p, "stop": stop}
        return {name: value for name, value in given.items() if value is not None}


def parse_request(body: bytes) -> ChatRequest:
    try:
        request = ChatRequest.model_validate(decode_json(body))
    except ValidationError as exc:
        item = exc.errors(include_url=False)[0]
        path = ".".join(str(p) for p in item["loc"]) or "body"
        raise invalid_request(f"{path}: {item['msg']}") from None
    except RecursionError:
        raise invalid_request("request body is nested too deeply") from None
    if request.n != 1:
        raise invalid_request("n: only n = 1 is supported")
    if request.messages[-1].role == "assistant":
        raise invalid_request("messages: the last message must not be an assistant message")
    return request


def to_chat(request: ChatRequest) -> ChatPrompt:
    """OpenAI messages -> the chat-template messages the turn core renders (arguments as objects)."""
    lead = 0
    while lead < len(request.messages) and request.messages[lead].role in ("system", "developer"):
        lead += 1
    system = "\n\n".join(m.text() for m in request.messages[:lead])
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}] if lead else []
    pending: set[str] = set()
    for i, message in enumerate(request.messages[lead:], start=lead):
        if message.role in ("system", "developer"):
            raise invalid_request(f"messages.{i}: system messages are only accepted at the start")
        if message.role == "assistant":
            chat.append(_assistant(message, i))
            pending = {call.id for call in message.tool_calls or ()}
        elif message.role == "tool":
            if message.tool_call_id not in pending:
                raise invalid_request(
                    f"messages.{i}: tool_call_id {message.tool_call_id!r} does not answer a tool call "
                    "of the previous assistant message"
                )
            chat.append({"role": "tool", "tool_call_id": message.tool_call_id, "content": message.text()})
        else:
            chat.append({"role": "user", "content": message.text()})
    tools = [tool.function.model_dump() for tool in request.tools or ()]
    names = [tool["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise invalid_request("tools: tool names must be unique")
    return ChatPrompt(chat, [{"type": "function", "function": tool} for tool in tools], system)


def _assistant(message: ChatMessage, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": message.text()}
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    calls = []
    for j, call in enumerate(message.tool_calls or ()):
        arguments: str | dict[str, Any] | None = call.function.arguments
        if isinstance(arguments, str):  # JSON inside JSON: as hostile as the body, checked the same way
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):  # bad JSON, or a number over the 4300-digit limit
                arguments = None
            else:
                check_json(arguments, strings=True)
        if not isinstance(arguments, dict):
            raise invalid_request(f"messages.{index}.tool_calls.{j}.function.arguments: not a JSON object")
        calls.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    if calls:
        out["tool_calls"] = calls
    return out


def completion(turn: AssistantTurn) -> dict[str, Any]:
    """The finished turn as an OpenAI ``chat.completion``."""
    reply: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
    if turn.reasoning is not None:
        reply["reasoning_content"] = turn.reasoning.text
    calls = [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in turn.tool_calls
    ]
    if calls:
        reply["tool_calls"] = calls
    return {
        "id": f"chatcmpl-{turn.id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": turn.model,
        "choices": [
            {
                "index": 0,
                "message": reply,
                "finish_reason": FINISH.get(turn.stop_reason or "", "stop"),
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": turn.input_tokens,
            "completion_tokens": turn.output_tokens,
            "total_tokens": turn.input_tokens + turn.output_tokens,
        },
    }


def error_response(err: ApiError) -> JSONResponse:
    """OpenAI's error shape (Chat Completions and Responses), with the retry hints."""
    body = {"error": {"message": err.message, "type": err.error_type, "param": None, "code": None}}
    return JSONResponse(body, status_code=err.status, headers=err.headers())


class ChatCompletions(WireProtocol[ChatRequest]):
    path = "/v1/chat/completions"
    harness = GYM  # and mini_swe_agent: sessions.ROUTES gives both this route

    def parse(self, body: bytes, settings: AdapterSettings) -> Call[ChatRequest]:
        request = parse_request(body)
        max_tokens = request.max_completion_tokens or request.max_tokens or settings.max_new_tokens
        turn = TurnInput(to_chat(request), request.model, max_tokens, request.sampling(), GYM)
        return Call(request, turn, request.stream)

    def body(self, call: Call[ChatRequest], turn: AssistantTurn) -> dict[str, Any]:
        return completion(turn)

    async def events(
        self, call: Call[ChatRequest], agent: Agent, events: AsyncIterator[TurnEvent], started: Started
    ) -> AsyncIterator[bytes]:
        """``chat.completion.chunk`` events: the whole reply, then the finish; SSE comments as pings."""
        try:
            async for item in events:
                if isinstance(item, Ping):
                    yield b": ping\n\n"
                elif isinstance(item, Done):
                    full = completion(item.turn)
                    choice = full["choices"][0]
                    base = {k: full[k] for k in ("id", "created", "model")} | {
                        "object": "chat.completion.chunk"
                    }
                    delta = {k: v for k, v in choice["message"].items() if v is not None}
                    for call_index, tool_call in enumerate(delta.get("tool_calls", ())):
                        tool_call["index"] = call_index
                    yield _sse(base | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
                    end = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
                    yield _sse(base | {"choices": [end], "usage": full["usage"]})
        except ApiError as err:  # the status line is gone: the error travels as an event
            error = {"message": err.message, "type": err.error_type, "param": None, "code": None}
            yield _sse({"error": error})
        yield b"data: [DONE]\n\n"

    def error(self, err: ApiError) -> Response:
        return error_response(err)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
