"""The wire protocols: each is one WireProtocol object in a module of its own, served by the one endpoint;
each renders the turn core's neutral AssistantTurn, and its errors, in its own shape. No app, no engine."""

from __future__ import annotations

import inspect
import json

from rollbus.services.adapter import app, wire
from rollbus.services.adapter.assistant import AssistantTurn, Reasoning, ToolCall
from rollbus.services.adapter.errors import overloaded
from rollbus.services.adapter.sessions import HARNESSES, ROUTES
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.wire import WireProtocol

TURN = AssistantTurn(
    "ab12", "m", Reasoning("think", "rb1.sig"), "done", (ToolCall("toolu_1", "Read", {"path": "/a"}),),
    "tool_use", None, 7, 3,
)  # fmt: skip
GO = [{"role": "user", "content": "go"}]
REQUESTS = {
    "/v1/messages": {"model": "m", "max_tokens": 8, "messages": GO},
    "/v1/chat/completions": {"model": "m", "messages": GO},
    "/v1/responses": {"model": "m", "input": "go", "tools": [{"type": "custom", "name": "Read"}]},
}
SETTINGS = AdapterSettings(sglang_url="http://engine")


def test_every_route_is_one_protocol_object_in_a_module_of_its_own() -> None:
    """A new protocol is one module and one entry in PROTOCOLS: nothing else routes a turn."""
    modules = [type(p).__module__ for p in app.PROTOCOLS.values()]
    assert len(set(modules)) == len(modules) == 3
    for path, protocol in app.PROTOCOLS.items():
        assert isinstance(protocol, WireProtocol) and protocol.path == path
        assert not inspect.isabstract(type(protocol))
        assert ROUTES[protocol.harness] == path  # the harness it serves has its token open this route
    assert set(ROUTES.values()) == set(app.PROTOCOLS)  # every harness reaches a protocol
    assert set(HARNESSES) == set(ROUTES)
    posted = {path for path, _, methods in app.ROUTES if "POST" in methods}
    assert set(app.PROTOCOLS) <= posted
    turn_routes = [path for path, endpoint, _ in app.ROUTES if endpoint.__module__ == wire.__name__]
    assert sorted(turn_routes) == sorted(app.PROTOCOLS)


def test_one_turn_renders_the_same_facts_in_each_protocol() -> None:
    """Each protocol parses its request to the same neutral input and renders one turn's facts its way."""
    calls = {
        path: p.parse(json.dumps(REQUESTS[path]).encode(), SETTINGS) for path, p in app.PROTOCOLS.items()
    }
    for call in calls.values():
        assert call.turn.chat.messages == [{"role": "user", "content": "go"}] and call.turn.model == "m"
    bodies = {path: p.body(calls[path], TURN) for path, p in app.PROTOCOLS.items()}
    messages = bodies["/v1/messages"]
    assert messages["id"] == "msg_ab12" and messages["stop_reason"] == "tool_use"
    assert [b["type"] for b in messages["content"]] == ["thinking", "text", "tool_use"]
    assert messages["content"][0]["signature"] == "rb1.sig" and messages["content"][2]["id"] == "toolu_1"
    assert (messages["usage"]["input_tokens"], messages["usage"]["output_tokens"]) == (7, 3)
    chat = bodies["/v1/chat/completions"]
    choice = chat["choices"][0]
    assert chat["id"] == "chatcmpl-ab12" and choice["finish_reason"] == "tool_calls"
    assert (choice["message"]["content"], choice["message"]["reasoning_content"]) == ("done", "think")
    (call,) = choice["message"]["tool_calls"]
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"path": "/a"}
    assert chat["usage"]["total_tokens"] == 10
    body = bodies["/v1/responses"]  # rendered with what its request offered: a custom tool's call is freeform
    assert body["id"] == "resp_ab12" and body["usage"]["total_tokens"] == 10
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "custom_tool_call"]
    assert [i["id"] for i in body["output"]] == ["rs_ab12_0", "msg_ab12_1", "ctc_ab12_2"]


def test_each_protocol_answers_errors_in_its_own_shape_with_the_same_retry_hints() -> None:
    err = overloaded("busy", 2)
    shapes = {path: p.error(err) for path, p in app.PROTOCOLS.items()}
    for response in shapes.values():
        assert response.status_code == 529
        assert (response.headers["retry-after"], response.headers["x-should-retry"]) == ("2", "true")
    anthropic = json.loads(shapes["/v1/messages"].body)
    assert anthropic == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
    for path in ("/v1/chat/completions", "/v1/responses"):
        body = json.loads(shapes[path].body)
        assert body == {"error": {"message": "busy", "type": "overloaded_error", "param": None, "code": None}}
