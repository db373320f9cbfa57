"""Requests written as a hostile (or just odd) client would: none of them may become a 500.

The policy runs inside the sandbox with the session token, so it can send the adapter anything: numbers
too long to convert, strings that are not valid Unicode, nesting deep enough to blow a recursion limit,
bodies that never finish, sampling settings the engine refuses.
"""

from __future__ import annotations

import asyncio
import json

from tests.test_adapter_protocol import DEAD_ENGINE, KEY, assert_error
from tests.test_adapter_support import BusPublisher, StalledEngine, adapter_client, body, served, settings

JSON = {**KEY, "content-type": "application/json"}


async def post_raw(raw: bytes, url: str = DEAD_ENGINE, **overrides):
    async with adapter_client(settings(url, **overrides), BusPublisher()) as client:
        return await client.post("/v1/messages", content=raw, headers=JSON)


async def test_a_5000_digit_integer_is_a_400_not_a_conversion_error() -> None:
    raw = json.dumps(body("hi", stream=False)).replace('"max_tokens": 256', '"max_tokens": ' + "9" * 5000)
    response = await post_raw(raw.encode())
    assert "number" in assert_error(response, 400, "invalid_request_error", retry=False)


async def test_integers_beyond_any_engine_type_are_400() -> None:
    for field in ("max_tokens", "top_k"):
        response = await post_raw(json.dumps(body("hi", stream=False, **{field: 2**80})).encode())
        assert field in assert_error(response, 400, "invalid_request_error", retry=False)


async def test_a_lone_surrogate_is_a_400_not_a_tokenizer_crash() -> None:
    for text in ('"\\ud800"', '"a\\udfffb"', '"\\ud800\\u0041"'):
        raw = json.dumps(body("PLACEHOLDER", stream=False)).replace('"PLACEHOLDER"', text)
        response = await post_raw(raw.encode())
        assert "surrogate" in assert_error(response, 400, "invalid_request_error", retry=False)


async def test_a_paired_surrogate_is_an_emoji_and_fine() -> None:
    async with StalledEngine([9707], released=True) as engine:
        raw = json.dumps(body("PLACEHOLDER", stream=False)).replace('"PLACEHOLDER"', '"\\ud83d\\ude00"')
        response = await post_raw(raw.encode(), engine.url)
    assert response.status_code == 200, response.text


async def test_deep_nesting_anywhere_is_a_400() -> None:
    deep: object = "x"
    for _ in range(600):  # parses, then blew Python's recursion limit in the chat template (500)
        deep = {"a": deep}
    history = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": deep}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
    ]
    for request in (body(history, stream=False), body("hi", stream=False, metadata=deep)):
        response = await post_raw(json.dumps(request).encode())
        assert "nested" in assert_error(response, 400, "invalid_request_error", retry=False)


async def test_a_body_shorter_than_its_length_is_a_408_after_the_body_timeout(caplog) -> None:
    from rollbus.services.adapter.app import create_app

    app = create_app(settings(DEAD_ENGINE, body_timeout=0.3), BusPublisher())
    async with served(app) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: r-1\r\ncontent-type: application/json\r\n"
            b"content-length: 1000\r\n\r\n" + b'{"model": "m"'
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
    assert head.startswith(b"HTTP/1.1 408"), head
    assert b"timeout_error" in head and b"1000" in head
    assert not [r for r in caplog.records if r.exc_info], "a slow client is not a bug: no traceback"


async def test_top_k_zero_means_disabled() -> None:
    async with StalledEngine([9707], released=True) as engine:
        response = await post_raw(json.dumps(body("hi", stream=False, top_k=0)).encode(), engine.url)
        assert response.status_code == 200, response.text
        assert "top_k" not in engine.bodies[0]["sampling_params"]
        response = await post_raw(json.dumps(body("hi", stream=False, top_k=5)).encode(), engine.url)
        assert engine.bodies[1]["sampling_params"]["top_k"] == 5


async def test_an_engine_4xx_is_a_400_the_cli_does_not_retry() -> None:
    async with StalledEngine(status=400) as engine:
        response = await post_raw(json.dumps(body("hi", stream=False, top_p=0.5)).encode(), engine.url)
        message = assert_error(response, 400, "invalid_request_error", retry=False)
        assert "bad sampling params" in message
        async with adapter_client(settings(engine.url), BusPublisher()) as client:
            streamed = await client.post("/v1/messages", json=body("hi"), headers=KEY)
        assert streamed.status_code == 200
        error = json.loads(streamed.text.strip().split("\n\n")[-1].split("data: ", 1)[1])
        assert error["error"]["type"] == "invalid_request_error"


async def test_closing_a_turn_aborts_the_engine_call_before_the_agent_is_free() -> None:
    """The engine call is closed with the turn (``aclosing``), not whenever the collector gets to it."""
    from rollbus.services.adapter.anthropic import parse_messages_request
    from rollbus.services.adapter.attribution import claude_code
    from rollbus.services.adapter.sessions import RequestShape
    from rollbus.services.adapter.translate import to_chat
    from rollbus.services.adapter.turn import Ping, Started, TurnInput, run_turn

    async with StalledEngine() as engine:
        async with adapter_client(settings(engine.url), BusPublisher()) as client:
            state = client.app.state.adapter
            request = parse_messages_request(json.dumps(body("hi")).encode())
            chat = to_chat(request.system, request.messages, request.tools)
            agent = claude_code(
                state.sessions.get("r-close"), RequestShape(None, chat.system, chat.messages, chat.tools)
            )
            events = run_turn(state.kit, agent, TurnInput(chat, "m", 64, {}))
            assert isinstance(await anext(events), Started)
            while engine.generating == 0:
                assert isinstance(await anext(events), Ping)
            await events.aclose()
            assert engine.aborted and not agent.lock.locked()
            assert agent.history.turns == []
