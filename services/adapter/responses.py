"""``POST /v1/responses``: the OpenAI Responses API as the Codex CLI uses it, one wire protocol.

Codex sends its whole history every call (``store: false``): developer instructions, user messages, and our
own earlier output items echoed verbatim (``reasoning``, ``message``, ``function_call``, ``custom_tool_call``)
with the tools' outputs. The items are translated to the chat messages the Anthropic route produces, so the
turn is planned on the rollout's canonical history and recorded exactly like a Claude Code turn. Each item we
emit translates back to what we committed (call ids, argument objects, reasoning text), so an echoed history
stitches onto the recorded tokens.

Tools: ``function`` tools pass through; a ``custom`` (freeform grammar) tool such as ``apply_patch`` is
offered to the model as a function with one string parameter ``input`` and its calls go back as
``custom_tool_call``; the functions of a ``namespace`` tool (Codex's sub-agent tools, ``multi_agent_v1``)
are offered by their own names and their calls go back as ``function_call`` items carrying that
``namespace`` (without it Codex answers "unsupported call"); hosted tools (``web_search``, ...) are not
offered (the runner's Codex config disables them).

Each Codex thread is its own conversation (``thread-id``; the root thread's id is the ``session-id``): the
root is the main agent, a sub-agent's thread becomes a ``subagent`` chain when it answers a ``spawn_agent``
call of main's (:func:`rollbus.services.adapter.attribution.codex_thread`), and its chain is complete
once main's request carries Codex's ``<subagent_notification>`` for it.

The stream is the one Codex reads (docs/codex-wire.md): ``response.created``, ``response.in_progress`` while
the engine works (Codex's idle timer counts events, not SSE comments), then per item
``response.output_item.added`` / ``.done``, then ``response.completed`` with usage; a failure after the
status line is a ``response.failed`` event.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from rollbus.services.adapter import stream_retry
from rollbus.services.adapter.assistant import AssistantTurn, Reasoning, Text
from rollbus.services.adapter.attribution import codex_thread, notified_subagents
from rollbus.services.adapter.bodies import check_json, decode_json
from rollbus.services.adapter.errors import ApiError, invalid_request
from rollbus.services.adapter.openai import error_response
from rollbus.services.adapter.sessions import CODEX, Agent, Session
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.translate import ChatPrompt
from rollbus.services.adapter.turn import Done, Ping, Started, TurnEvent, TurnInput
from rollbus.services.adapter.wire import Call, WireProtocol, shape

_MODEL = ConfigDict(extra="ignore", frozen=True)
FREEFORM_PARAMETER = "input"  # the one string parameter a custom tool is offered with
ASSISTANT_ITEMS = ("reasoning", "function_call", "custom_tool_call")
OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output")
EVENT_STREAM = "text/event-stream"
THREAD_HEADER, ROOT_HEADER = "thread-id", "session-id"  # Codex: this conversation's thread, its root's


class Part(BaseModel):
    model_config = _MODEL
    type: str
    text: str = ""


class Item(BaseModel):
    """One ``input`` item; which fields matter depends on ``type`` (checked in :func:`to_chat`)."""

    model_config = _MODEL
    type: str = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[Part] | None = None
    summary: list[Part] | None = None
    name: str | None = None
    arguments: str | None = None
    input: str | None = None
    call_id: str | None = None
    output: str | list[Part] | None = None

    def text(self) -> str:
        parts = self.content
        return parts if isinstance(parts, str) else "".join(p.text for p in parts or ())


class ResponsesRequest(BaseModel):
    model_config = _MODEL
    model: str = Field(min_length=1)
    input: str | list[Item]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)

    def sampling(self) -> dict[str, Any]:
        given = {"temperature": self.temperature, "top_p": self.top_p}
        return {name: value for name, value in given.items() if value is not None}

    def items(self) -> list[Item]:
        return [Item(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)


def parse_request(body: bytes) -> ResponsesRequest:
    try:
        return ResponsesRequest.model_validate(decode_json(body))
    except ValidationError as exc:
        item = exc.errors(include_url=False)[0]
        path = ".".join(str(p) for p in item["loc"]) or "body"
        raise invalid_request(f"{path}: {item['msg']}") from None
    except RecursionError:
        raise invalid_request("request body is nested too deeply") from None


def offered_tools(tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """Codex's tools as chat-template functions, and the names of the freeform (custom) ones; a namespace's
    functions are offered by their own names (:func:`namespaces` says which namespace each came from)."""
    functions: list[dict[str, Any]] = []
    custom: set[str] = set()
    for i, tool in _flat_tools(tools):
        kind, name = tool.get("type"), tool.get("name")
        if kind not in ("function", "custom"):
            continue  # hosted tools (web_search, ...): not offered
        if not isinstance(name, str) or not name:
            raise invalid_request(f"tools.{i}.name: a non-empty string is required")
        if kind == "custom":
            custom.add(name)
            parameters = {
                "type": "object",
                "properties": {FREEFORM_PARAMETER: {"type": "string", "description": "the raw tool input"}},
                "required": [FREEFORM_PARAMETER],
            }
        else:
            parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        function = {"name": name, "description": tool.get("description") or "", "parameters": parameters}
        functions.append({"type": "function", "function": function})
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid_request("tools: tool names must be unique")
    return functions, frozenset(custom)


def _flat_tools(tools: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(where, tool)`` for each top-level tool and each function inside a ``namespace`` tool."""
    flat = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid_request(f"tools.{i}: an object is required")
        inner = tool.get("tools") if tool.get("type") == "namespace" else None
        if inner is None:
            flat.append((str(i), tool))
            continue
        if not isinstance(inner, list) or not all(isinstance(t, dict) for t in inner):
            raise invalid_request(f"tools.{i}.tools: a list of objects is required")
        flat.extend((f"{i}.tools.{j}", t) for j, t in enumerate(inner) if t.get("type") == "function")
    return flat


def namespaces(tools: list[dict[str, Any]]) -> dict[str, str]:
    """Function name -> the namespace it was offered in, for the functions inside ``namespace`` tools."""
    found: dict[str, str] = {}
    for tool in tools:
        if tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            inner = [t for t in tool.get("tools") or () if isinstance(t, dict)]
            found.update((t["name"], tool["name"]) for t in inner if isinstance(t.get("name"), str))
    return found


def to_chat(request: ResponsesRequest) -> ChatPrompt:
    """Responses items -> chat-template messages: leading developer/system text is the system prompt; the
    assistant items between two user or tool items are one assistant message (reasoning, text, calls)."""
    items = request.items()
    lead = 0
    while lead < len(items) and items[lead].type == "message" and items[lead].role in ("system", "developer"):
        lead += 1
    system = "\n\n".join(
        [request.instructions or ""] * bool(request.instructions) + [i.text() for i in items[:lead]]
    )
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    turn: dict[str, Any] | None = None  # the assistant message being gathered
    pending: set[str] = set()
    for index, item in enumerate(items[lead:], start=lead):
        assistant = item.type in ASSISTANT_ITEMS or (item.type == "message" and item.role == "assistant")
        if assistant:
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                chat.append(turn)
                pending = set()
            _gather(turn, item, index, pending)
            continue
        turn = None
        if item.type in OUTPUT_ITEMS:
            if item.call_id not in pending:
                raise invalid_request(
                    f"input.{index}: call_id {item.call_id!r} does not answer a call of the assistant turn "
                    "before it"
                )
            output = (
                item.output if isinstance(item.output, str) else "".join(p.text for p in item.output or ())
            )
            chat.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        elif item.type == "message":
            chat.append({"role": "user", "content": item.text()})  # a later developer message too
        else:
            raise invalid_request(f"input.{index}: items of type {item.type!r} are not supported")
    functions, _ = offered_tools(request.tools or [])
    return ChatPrompt(chat, functions, system)


def _gather(turn: dict[str, Any], item: Item, index: int, pending: set[str]) -> None:
    where = f"input.{index}"
    if item.type == "reasoning":
        text = "".join(p.text for p in (item.content if isinstance(item.content, list) else []))
        text = text or "".join(p.text for p in item.summary or ())
        turn["reasoning_content"] = "\n\n".join(filter(None, [turn.get("reasoning_content"), text]))
        return
    if item.type == "message":
        turn["content"] = "\n\n".join(filter(None, [turn["content"], item.text()]))
        return
    if not item.call_id or not item.name:
        raise invalid_request(f"{where}: a call needs call_id and name")
    if item.type == "custom_tool_call":
        arguments: Any = {FREEFORM_PARAMETER: item.input or ""}
    else:
        try:  # JSON inside JSON: as hostile as the body, checked the same way
            arguments = json.loads(item.arguments) if item.arguments and item.arguments.strip() else {}
        except (ValueError, RecursionError):
            arguments = None
        else:
            check_json(arguments, strings=True)
        if not isinstance(arguments, dict):
            raise invalid_request(f"{where}.arguments: not a JSON object")
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
    turn.setdefault("tool_calls", []).append(call)
    pending.add(item.call_id)


def output_items(
    turn: AssistantTurn, custom: frozenset[str], spaces: Mapping[str, str] = MappingProxyType({})
) -> list[dict[str, Any]]:
    """The turn's parts as Responses output items, in the order written.

    Each item translates back (:func:`to_chat`) to what was committed: the reasoning text, the text, and
    each call with our tool call id as its ``call_id`` and its arguments; a call of a namespace's function
    (``spaces``, from :func:`namespaces`) carries that ``namespace``."""
    items: list[dict[str, Any]] = []
    for i, part in enumerate(turn.parts()):
        if isinstance(part, Reasoning):
            items.append(
                {"type": "reasoning", "id": f"rs_{turn.id}_{i}", "summary": [],
                 "content": [{"type": "reasoning_text", "text": part.text}]}
            )  # fmt: skip
        elif isinstance(part, Text):
            items.append(
                {"type": "message", "id": f"msg_{turn.id}_{i}", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": part.text, "annotations": []}]}
            )  # fmt: skip
        elif part.name in custom:
            raw = part.arguments.get(FREEFORM_PARAMETER, "")
            raw = raw if isinstance(raw, str) else json.dumps(raw)
            items.append(
                {"type": "custom_tool_call", "id": f"ctc_{turn.id}_{i}", "status": "completed",
                 "call_id": part.id, "name": part.name, "input": raw}
            )  # fmt: skip
        else:
            items.append(
                {"type": "function_call", "id": f"fc_{turn.id}_{i}", "status": "completed",
                 "call_id": part.id, "name": part.name, "arguments": json.dumps(part.arguments)}
            )  # fmt: skip
            if part.name in spaces:
                items[-1]["namespace"] = spaces[part.name]
    return items


def response_body(
    turn: AssistantTurn,
    custom: frozenset[str],
    status: str = "completed",
    spaces: Mapping[str, str] = MappingProxyType({}),
) -> dict[str, Any]:
    return {
        "id": f"resp_{turn.id}",
        "object": "response",
        "status": status,
        "model": turn.model,
        "output": output_items(turn, custom, spaces) if status == "completed" else [],
        "usage": {
            "input_tokens": turn.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": turn.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": turn.input_tokens + turn.output_tokens,
        },
    }


class Responses(WireProtocol[ResponsesRequest]):
    path = "/v1/responses"
    harness = CODEX

    def parse(self, body: bytes, settings: AdapterSettings) -> Call[ResponsesRequest]:
        request = parse_request(body)
        max_tokens = request.max_output_tokens or settings.max_new_tokens
        turn = TurnInput(to_chat(request), request.model, max_tokens, request.sampling(), CODEX)
        return Call(request, turn, request.stream)

    def agent(self, session: Session, call: Call[ResponsesRequest], request: Request) -> Agent:
        thread, root = request.headers.get(THREAD_HEADER), request.headers.get(ROOT_HEADER)
        return codex_thread(session, shape(call.turn.chat, request), thread, root)

    def finished_subagents(self, session: Session, call: Call[ResponsesRequest]) -> list[Agent]:
        return notified_subagents(session, call.turn.chat.messages)

    def replay(self, agent: Agent, call: Call[ResponsesRequest]) -> Response | None:
        """A cut stream retried: the rest of the recorded turn, nothing sampled again (stream_retry.py)."""
        if not call.stream:
            return None
        history = agent.history
        owed = stream_retry.rest(
            agent.answered, call.request.items(), call.request.tools, history.chain_id, len(history.turns)
        )
        if owed is None:
            return None
        replay = replay_events(agent.answered.response, owed)
        return StreamingResponse(replay, media_type=EVENT_STREAM, headers={"cache-control": "no-cache"})

    def body(self, call: Call[ResponsesRequest], turn: AssistantTurn) -> dict[str, Any]:
        tools = call.request.tools or []
        return response_body(turn, offered_tools(tools)[1], spaces=namespaces(tools))

    def events(
        self, call: Call[ResponsesRequest], agent: Agent, events: AsyncIterator[TurnEvent], started: Started
    ) -> AsyncIterator[bytes]:
        tools = call.request.tools or []
        remember = functools.partial(_remember, agent, call.request)
        return response_events(events, started, offered_tools(tools)[1], remember, namespaces(tools))

    def error(self, err: ApiError) -> Response:
        return error_response(err)


async def response_events(
    events: AsyncIterator[TurnEvent],
    started: Started,
    custom: frozenset[str],
    remember: Callable[[dict[str, Any]], None] = lambda body: None,
    spaces: Mapping[str, str] = MappingProxyType({}),
) -> AsyncIterator[bytes]:
    """The turn's stream; ``remember`` gets the completed body (the turn is committed) before any item is
    sent, so a retry after a cut finds it."""
    head = response_body(started.turn, custom, status="in_progress")
    yield _sse("response.created", {"response": head})
    try:
        async for item in events:
            if isinstance(item, Ping):
                yield _sse("response.in_progress", {"response": head})
            elif isinstance(item, Done):
                body = response_body(item.turn, custom, spaces=spaces)
                remember(body)
                for chunk in _items_and_completion(body):
                    yield chunk
    except ApiError as err:  # the status line is gone: the failure travels as an event
        error = {"code": err.error_type, "message": err.message}
        yield _sse("response.failed", {"response": head | {"status": "failed", "error": error}})


async def replay_events(answered: dict[str, Any], owed: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The stream answering a retry: the items the cut kept from the client, then completion."""
    body = answered | {"output": owed}
    yield _sse("response.created", {"response": body | {"status": "in_progress", "output": []}})
    for chunk in _items_and_completion(body):
        yield chunk


def _items_and_completion(body: dict[str, Any]) -> Iterator[bytes]:
    for index, output in enumerate(body["output"]):
        yield _sse("response.output_item.added", {"output_index": index, "item": output})
        yield _sse("response.output_item.done", {"output_index": index, "item": output})
    yield _sse("response.completed", {"response": body})


def _remember(agent: Any, request: ResponsesRequest, body: dict[str, Any]) -> None:
    """What :mod:`stream_retry` needs to answer a retry of ``request``, whose turn was just committed."""
    echoes = tuple(Item.model_validate(output) for output in body["output"])
    history = agent.history
    agent.answered = stream_retry.Answered(
        tuple(request.items()), request.tools, echoes, body, history.chain_id, len(history.turns)
    )


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n".encode()
