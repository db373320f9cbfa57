"""``POST /v1/chat/completions`` against the real rollbus engine (scripted policy, real logprobs).

What it must share with ``/v1/messages``: the session token, the canonical history (an echoed reply extends
the chain token for token; a rewritten history freezes it and opens the next), the turn and session events.
"""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from rollbus.services.adapter.app import create_app
from tests.test_adapter_support import (
    BusPublisher,
    scripted_adapter,
    served,
    settings,
)

CALL = (
    "I will compute it.\n</think>\n\n<tool_call>\n<function=python>\n<parameter=code>\nprint(6 * 7)\n"
    "</parameter>\n</function>\n</tool_call>"
)
SCRIPT = {"turns": [CALL, "It printed 42.\n</think>\n\n<answer>42</answer>", "Again.\n</think>\n\nStill 42."]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "run python",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string"}},
                "required": ["code"],
            },
        },
    }
]


@pytest.fixture
async def adapter(engine_url):
    async with scripted_adapter(engine_url) as client:
        yield client


def token() -> dict[str, str]:
    return {"authorization": f"Bearer r-{uuid.uuid4().hex[:8]}"}


def opening() -> list[dict]:
    return [{"role": "system", "content": "You compute."}, {"role": "user", "content": "What is 6 * 7?"}]


async def complete(client, messages, headers, **extra) -> dict:
    body = {"model": "rollbus-engine", "messages": messages, "tools": TOOLS, "max_tokens": 200, **extra}
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


async def test_tool_call_then_answer_extends_one_chain_token_for_token(adapter) -> None:
    headers = token()
    rollout = headers["authorization"].split()[1]
    first = await complete(adapter, opening(), headers)
    choice = first["choices"][0]
    assert first["object"] == "chat.completion" and choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "python" and json.loads(call["function"]["arguments"]) == {
        "code": "print(6 * 7)"
    }
    assert choice["message"]["reasoning_content"] == "I will compute it."
    history = [*opening(), choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "42\n"}]
    second = await complete(adapter, history, headers)
    assert second["choices"][0]["message"]["content"] == "<answer>42</answer>"
    assert second["choices"][0]["finish_reason"] == "stop"

    turns = adapter.publisher.of("turns", rollout)
    assert [(t["chain_id"], t["turn_index"], t["chain_kind"]) for t in turns] == [
        ("main", 0, "main"),
        ("main", 1, "main"),
    ]
    assert turns[1]["prompt_ref_turn"] == 0  # the echoed reply was recognised: prompt = stream + suffix
    assert first["usage"]["prompt_tokens"] == turns[0]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == len(turns[0]["output_ids"])
    sessions = adapter.publisher.of("sessions", rollout)
    assert [(s["kind"], s["chain_id"]) for s in sessions] == [("opened", "main")]


async def test_a_rewritten_history_freezes_the_chain_and_opens_the_next(adapter) -> None:
    """A context manager dropping a middle turn breaks the token prefix: a new chain, never silent drift."""
    headers = token()
    rollout = headers["authorization"].split()[1]
    first = await complete(adapter, opening(), headers, tools=None)
    reply = first["choices"][0]["message"]
    await complete(adapter, [*opening(), reply, {"role": "user", "content": "and now?"}], headers, tools=None)
    rewritten = [opening()[0], {"role": "user", "content": "What is 6 * 7? (earlier turns dropped)"}]
    await complete(adapter, rewritten, headers, tools=None)
    sessions = adapter.publisher.of("sessions", rollout)
    assert [(s["kind"], s["chain_id"]) for s in sessions] == [
        ("opened", "main"),
        ("frozen", "main"),
        ("opened", "main.1"),
    ]
    assert sessions[1]["turn_count"] == 2 and sessions[1]["reason"] == "compaction"
    turns = adapter.publisher.of("turns", rollout)
    assert [t["chain_id"] for t in turns] == ["main", "main", "main.1"]
    assert all(t["chain_kind"] == "main" for t in turns)  # tool-less requests are not side calls here


async def test_the_official_openai_client_talks_to_it_and_streams(engine_url) -> None:
    publisher = BusPublisher()
    app = create_app(settings(engine_url, admin_token="adm", open_sessions=False), publisher)
    async with app.router.lifespan_context(app), served(app) as (url, _):
        async with httpx.AsyncClient(base_url=url, headers={"authorization": "Bearer adm"}) as admin:
            opened = await admin.post("/admin/sessions", json={"rollout_id": "r-official", "harness": "gym"})
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=opened.json()["token"])
        result = await client.chat.completions.create(
            model="rollbus-engine", messages=opening(), tools=TOOLS, max_tokens=200
        )
        call = result.choices[0].message.tool_calls[0]
        assert call.function.name == "python" and result.choices[0].finish_reason == "tool_calls"
        stream = await client.chat.completions.create(
            model="rollbus-engine", messages=opening(), max_tokens=200, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "<answer>42</answer>"
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="r-official").chat.completions.create(
                model="m", messages=opening()
            )
        await client.close()
    turns = [e for t, _, e in publisher.events if t == "turns"]
    assert [(e["rollout_id"], e["finish_reason"]) for e in turns] == [("r-official", "stop")] * 2


def called(arguments: str) -> list[dict]:
    """A conversation whose assistant turn calls a tool with these raw ``arguments``."""
    call = {"id": "t", "type": "function", "function": {"name": "python", "arguments": arguments}}
    return [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "t", "content": "y"}]  # fmt: skip


@pytest.mark.parametrize(
    ("patch", "status", "needle"),
    [
        ({"n": 2}, 400, "only n = 1"),
        ({"messages": [{"role": "assistant", "content": "prefill"}]}, 400, "last message"),
        ({"messages": [{"role": "user", "content": "x"},
                       {"role": "tool", "tool_call_id": "t1", "content": "y"}]},
         400, "does not answer"),
        ({"messages": [{"role": "user", "content": "x"},
                       {"role": "assistant", "tool_calls": [{"id": "t", "function": {"name": "python",
                                                                                 "arguments": "[1]"}}]},
                       {"role": "tool", "tool_call_id": "t", "content": "y"}]}, 400, "not a JSON object"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]},
         400, "only accepted at the start"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"messages": called('{"code": ' + "9" * 5000 + "}")}, 400, "not a JSON object"),
        ({"messages": called('{"code": ' + "[" * 100_000 + "]" * 100_000 + "}")}, 400, "not a JSON object"),
        ({"messages": called('{"x": ' + "[" * 300 + "]" * 300 + "}")}, 400, "nested too deeply"),
        ({"messages": called('{"code": "\\ud800"}')}, 400, "surrogate"),
        ({"messages": "hello"}, 400, "messages"),
    ],
)  # fmt: skip
async def test_bad_requests_get_openai_shaped_errors_and_record_nothing(
    adapter, patch, status, needle
) -> None:
    headers = token()
    body = {"model": "m", "messages": opening(), **patch}
    response = await adapter.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    assert adapter.publisher.events == []


async def test_unknown_token_and_too_long_prompt(adapter) -> None:
    response = await adapter.post("/v1/chat/completions", json={"model": "m", "messages": opening()})
    assert response.status_code == 401 and "session token" in response.json()["error"]["message"]
    long = [{"role": "user", "content": "word " * 5000}]
    response = await adapter.post(
        "/v1/chat/completions", json={"model": "m", "messages": long}, headers=token()
    )
    assert response.status_code == 400 and "prompt is too long" in response.json()["error"]["message"]


async def test_a_tampered_echo_starts_a_new_chain_instead_of_training_on_it(adapter) -> None:
    """The client (or a policy steering it) edits the model's reply before echoing it: the adapter must not
    splice those unsampled tokens into the chain as if the model had written them."""
    headers = token()
    rollout = headers["authorization"].split()[1]
    first = await complete(adapter, opening(), headers)
    reply = dict(first["choices"][0]["message"])
    call = dict(reply["tool_calls"][0])
    call["function"] = {
        "name": "python",
        "arguments": json.dumps({"code": "import os; os.system('rm -rf /')"}),
    }
    reply["tool_calls"] = [call]
    history = [*opening(), reply, {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
    await complete(adapter, history, headers)
    sessions = adapter.publisher.of("sessions", rollout)
    assert [(s["kind"], s["chain_id"], s["reason"]) for s in sessions][1:] == [
        ("frozen", "main", "unmatched_assistant"),
        ("opened", "main.1", "unmatched_assistant"),
    ]
    second = adapter.publisher.of("turns", rollout)[1]
    assert second["chain_id"] == "main.1" and second["prompt_ref_turn"] is None  # a fresh full render
