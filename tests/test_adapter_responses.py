"""``POST /v1/responses`` (the Codex CLI's API) against the real rollbus engine (scripted, real logprobs).

What it must share with the other routes: the session token (bound to the rollout and to the codex harness),
the canonical history (Codex resends every item; our own items echoed back extend the chain token for
token), the turn and session events. And what is its own: the item types Codex expects back
(``function_call``, ``custom_tool_call`` for a freeform tool, ``reasoning``, ``message``) in the event order
it reads.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from rollbus.services.adapter.app import create_app
from rollbus.services.adapter.assistant import AssistantTurn, Reasoning, ToolCall
from rollbus.services.adapter.responses import ResponsesRequest, output_items, to_chat
from tests.test_adapter_support import (
    BusPublisher,
    adapter_client,
    engine_process,
    scripted_adapter,
    served,
    settings,
)

EXEC = (
    "Look first.\n</think>\n\n<tool_call>\n<function=exec_command>\n<parameter=cmd>\ncat calc.py\n"
    "</parameter>\n<parameter=yield_time_ms>\n1000\n</parameter>\n</function>\n</tool_call>"
)
PATCH_TEXT = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
PATCH = (
    "Now patch.\n</think>\n\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n"
    f"{PATCH_TEXT}\n</parameter>\n</function>\n</tool_call>"
)
SCRIPT = {"turns": [EXEC, PATCH, "Done.\n</think>\n\nAdded a.txt."]}
CLAUDE_CODE_SCRIPT = {"turns": ["Answer.\n</think>\n\nAnswered on the Messages route."]}
TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}},
            "required": ["cmd"],
        },
    },
    {"type": "custom", "name": "apply_patch", "description": "Edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
    {"type": "web_search", "external_web_access": False},
]  # fmt: skip


def opening() -> list[dict]:
    return [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You code."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a.txt."}]},
    ]


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    # the Codex route's turns come from SCRIPT, any other route's from CLAUDE_CODE_SCRIPT
    with engine_process(CLAUDE_CODE_SCRIPT, tmp_path_factory.mktemp("engine"), codex_script=SCRIPT) as url:
        yield url


@pytest.fixture
async def adapter(engine_url):
    async with scripted_adapter(engine_url, open_sessions=False) as client:
        yield client


async def open_session(client, harness: str = "codex") -> tuple[str, dict[str, str]]:
    rollout = f"r-{uuid.uuid4().hex[:8]}"
    opened = await client.post(
        "/admin/sessions",
        json={"rollout_id": rollout, "harness": harness},
        headers={"authorization": "Bearer adm"},
    )
    assert opened.status_code == 200, opened.text
    return rollout, {"authorization": f"Bearer {opened.json()['token']}"}


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event; every data carries its own ``type``, equal to the name."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


async def respond(client, items: list[dict], headers: dict[str, str]) -> list[tuple[str, dict]]:
    body = {"model": "rollbus-engine", "input": items, "tools": TOOLS, "stream": True, "store": False}
    response = await client.post("/v1/responses", json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return sse(response.text)


def done_items(events: list[tuple[str, dict]]) -> list[dict]:
    return [data["item"] for name, data in events if name == "response.output_item.done"]


async def test_shell_call_then_freeform_patch_then_answer_extend_one_chain(adapter) -> None:
    rollout, headers = await open_session(adapter)
    first = await respond(adapter, opening(), headers)
    names = [name for name, _ in first]
    assert names[0] == "response.created" and names[-1] == "response.completed"
    assert set(names[1:-1]) <= {
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
    }
    reasoning, call = done_items(first)
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "Look first."
    assert call["type"] == "function_call" and call["name"] == "exec_command"
    assert json.loads(call["arguments"]) == {"cmd": "cat calc.py", "yield_time_ms": 1000}  # typed by schema

    ran = {"type": "function_call_output", "call_id": call["call_id"], "output": "Process exited with code 0"}
    history = [*opening(), *done_items(first), ran]
    second = await respond(adapter, history, headers)
    patch = done_items(second)[-1]
    assert patch["type"] == "custom_tool_call" and patch["name"] == "apply_patch"
    assert patch["input"] == PATCH_TEXT and "arguments" not in patch

    applied = {"type": "custom_tool_call_output", "call_id": patch["call_id"], "output": "Success. A a.txt"}
    history += [*done_items(second), applied]
    third = await respond(adapter, history, headers)
    message = done_items(third)[-1]
    assert message["type"] == "message" and message["content"][0]["text"] == "Added a.txt."
    completed = third[-1][1]["response"]
    assert completed["status"] == "completed" and completed["output"] == done_items(third)

    turns = adapter.publisher.of("turns", rollout)
    assert [(t["chain_id"], t["turn_index"], t["prompt_ref_turn"]) for t in turns] == [
        ("main", 0, None), ("main", 1, 0), ("main", 2, 1),
    ]  # fmt: skip
    assert completed["usage"]["input_tokens"] == turns[2]["prompt_tokens"]
    assert completed["usage"]["output_tokens"] == len(turns[2]["output_ids"])
    assert [(s["kind"], s["chain_id"]) for s in adapter.publisher.of("sessions", rollout)] == [
        ("opened", "main")
    ]


def test_every_item_it_emits_translates_back_to_what_was_committed() -> None:
    """The stitching invariant: output items echoed as input render to the committed assistant message."""
    calls = (
        ToolCall("toolu_1", "exec_command", {"cmd": "ls", "tty": False}),
        ToolCall("toolu_2", "apply_patch", {"input": "*** Begin Patch\n"}),
    )
    turn = AssistantTurn("x", "m", Reasoning("why", "s"), "so", calls)
    items = output_items(turn, frozenset({"apply_patch"}))
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "custom_tool_call"]
    outputs = [{"type": "function_call_output", "call_id": "toolu_1", "output": "a"},
               {"type": "custom_tool_call_output", "call_id": "toolu_2", "output": "b"}]  # fmt: skip
    request = ResponsesRequest.model_validate({"model": "m", "input": [*opening(), *items, *outputs]})
    chat = to_chat(request).messages
    assert chat[2] == turn.chat_message()  # what the turn core committed
    assert chat[3:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "a"},
                        {"role": "tool", "tool_call_id": "toolu_2", "content": "b"}]  # fmt: skip


async def test_tokens_are_bound_to_their_rollout_and_to_the_codex_harness(adapter) -> None:
    _, claude_code = await open_session(adapter, "claude_code")
    body = {"model": "m", "input": opening(), "stream": True}
    refused = await adapter.post("/v1/responses", json=body, headers=claude_code)
    assert refused.status_code == 403 and "claude_code" in refused.json()["error"]["message"]
    rollout, codex = await open_session(adapter)
    on_messages = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    assert (await adapter.post("/v1/messages", json=on_messages, headers=codex)).status_code == 403
    closed = await adapter.post(f"/admin/sessions/{rollout}/close", headers={"authorization": "Bearer adm"})
    assert closed.status_code in (200, 404)
    gone = await adapter.post("/v1/responses", json=body, headers=codex)
    assert gone.status_code == 401 and "session token" in gone.json()["error"]["message"]
    assert (await adapter.post("/v1/responses", json=body)).status_code == 401
    assert adapter.publisher.events == [] or all(t != "turns" for t, _, _ in adapter.publisher.events)


async def test_the_engine_answers_each_route_with_its_harness_s_script(adapter) -> None:
    """What failed: the engine could not tell a Codex request from a Claude Code one, so a dataset mixing the
    harnesses got one harness's scripts for both (the other's tool calls fail). Each route names its harness
    to the engine: the Responses route's turns come from --codex-script (the test above), the Messages
    route's from --script."""
    _, claude_code = await open_session(adapter, "claude_code")
    read = {"name": "Read", "description": "Reads a file.",
            "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}  # fmt: skip
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "x"}], "tools": [read]}
    answer = await adapter.post("/v1/messages", json=body, headers=claude_code)  # with tools: its main chain
    assert answer.status_code == 200, answer.text
    said = json.dumps(answer.json()["content"])
    assert "Answered on the Messages route." in said and "exec_command" not in said, said


def answered(call_id: str, kind: str = "function_call_output") -> list[dict]:
    return [*opening(), {"type": kind, "call_id": call_id, "output": "y"}]


def called(arguments: str) -> list[dict]:
    call = {"type": "function_call", "call_id": "c", "name": "exec_command", "arguments": arguments}
    return [*opening(), call, {"type": "function_call_output", "call_id": "c", "output": "y"}]


@pytest.mark.parametrize(
    ("input_items", "needle"),
    [
        (answered("nobody"), "does not answer"),
        (answered("nobody", "custom_tool_call_output"), "does not answer"),
        ([*opening(), {"type": "compaction_summary", "encrypted_content": "x"}], "not supported"),
        (called("[1]"), "not a JSON object"),
        (called('{"cmd": ' + "[" * 300 + "]" * 300 + "}"), "nested too deeply"),
        (called('{"cmd": "\\ud800"}'), "surrogate"),
        ([*opening(), {"type": "function_call", "arguments": "{}"}], "call_id and name"),
        ("", None),
    ],
)  # fmt: skip
async def test_bad_inputs_get_a_400_and_record_nothing(adapter, input_items, needle) -> None:
    _, headers = await open_session(adapter)
    body = {"model": "m", "input": input_items if input_items != "" else 7, "stream": True}
    response = await adapter.post("/v1/responses", json=body, headers=headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and (needle is None or needle in error["message"])
    assert [t for t, _, _ in adapter.publisher.events if t == "turns"] == []


async def test_a_prompt_over_the_context_is_a_plain_400_before_any_event(adapter) -> None:
    _, headers = await open_session(adapter)
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "word " * 5000}]}]
    response = await adapter.post(
        "/v1/responses", json={"model": "m", "input": items, "stream": True}, headers=headers
    )
    assert response.status_code == 400 and "prompt is too long" in response.json()["error"]["message"]


async def test_a_non_streaming_request_gets_the_response_object(engine_url) -> None:
    publisher = BusPublisher()
    app = create_app(settings(engine_url, admin_token="adm", open_sessions=False), publisher)
    async with app.router.lifespan_context(app), served(app) as (url, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            opened = await http.post("/admin/sessions", json={"rollout_id": "r-plain", "harness": "codex"},
                                     headers={"authorization": "Bearer adm"})  # fmt: skip
            token = {"authorization": f"Bearer {opened.json()['token']}"}
            response = await http.post(
                "/v1/responses", json={"model": "m", "input": "Add a.txt.", "tools": TOOLS}, headers=token
            )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert [i["type"] for i in body["output"]] == ["reasoning", "function_call"]


async def test_an_internal_error_reaches_codex_in_the_responses_error_shape(engine_url) -> None:
    """What was wrong: a bug on /v1/responses answered in Anthropic's shape (``{"type": "error", ...}``),
    which Codex does not read as an error of its API. Now every error leaves in its route's shape."""
    config = settings(engine_url, admin_token="adm", open_sessions=False)
    async with adapter_client(config, BusPublisher(), raise_app_exceptions=False) as client:
        client.app.state.adapter.kit.outbox.max_event_bytes = 200  # the turn's record fails: a 500
        _, headers = await open_session(client)
        body = {"model": "rollbus-engine", "input": "Read /repo/app.py", "tools": TOOLS, "stream": False}
        response = await client.post("/v1/responses", json=body, headers=headers)
    assert response.status_code == 500 and "type" not in response.json()
    error = response.json()["error"]
    assert error["type"] == "api_error" and "RecordTooLarge" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
