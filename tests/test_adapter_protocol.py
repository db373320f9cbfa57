"""The adapter's HTTP contract without a model: every error path, admission, drain and bus outage."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest

from rollbus.services.adapter.app import create_app
from rollbus.services.adapter.main import install_drain
from rollbus.tokenizer import load_tokenizer
from tests.test_adapter_support import (
    READ_TOOL,
    BusPublisher,
    StalledEngine,
    adapter_client,
    body,
    free_port,
    served,
    settings,
    sse_events,
)

KEY = {"x-api-key": "rollout-protocol"}
DEAD_ENGINE = f"http://127.0.0.1:{free_port()}"  # nothing listens there


def assert_error(response, status: int, error_type: str, *, retry: bool | None) -> str:
    assert response.status_code == status, response.text
    data = response.json()
    assert data["type"] == "error" and data["error"]["type"] == error_type
    if retry is not None:
        assert response.headers["x-should-retry"] == ("true" if retry else "false")
    return data["error"]["message"]


async def test_root_health_and_metrics() -> None:
    async with adapter_client(settings(DEAD_ENGINE), BusPublisher()) as client:
        assert (await client.head("/")).status_code == 200
        health = await client.get("/healthz")
        assert health.json()["status"] == "ok"
        await client.post("/v1/messages", json=body("hi"))  # a 401 to count
        await client.post("/admin/sessions/r-1/close")  # a 403, counted under its route template
        await client.get("/no/such/page")
        metrics = (await client.get("/metrics")).text
        assert 'rollbus_adapter_requests_total{route="/v1/messages",status="401"} 1.0' in metrics
        assert 'route="/admin/sessions/{rollout_id}/close",status="403"} 1.0' in metrics
        assert 'rollbus_adapter_requests_total{route="unmatched",status="404"} 1.0' in metrics


@pytest.mark.parametrize(
    "headers, message",
    [
        ({}, "missing session token"),
        ({"x-api-key": "nope"}, "unknown session token"),
        ({"authorization": "Basic abc"}, "missing session token"),
    ],
)
async def test_unknown_or_missing_token_is_401_without_retry(headers, message) -> None:
    async with adapter_client(settings(DEAD_ENGINE, open_sessions=False), BusPublisher()) as client:
        response = await client.post("/v1/messages?beta=true", json=body("hi"), headers=headers)
        assert message in assert_error(response, 401, "authentication_error", retry=False)


async def test_admin_issues_tokens_that_name_the_rollout() -> None:
    publisher = BusPublisher()
    async with adapter_client(
        settings(DEAD_ENGINE, open_sessions=False, admin_token="adm"), publisher
    ) as client:
        refused = await client.post("/admin/sessions", json={"rollout_id": "r-7"}, headers={"x-api-key": "x"})
        assert_error(refused, 401, "authentication_error", retry=False)
        bad = await client.post(
            "/admin/sessions", json={"rollout": 1}, headers={"authorization": "Bearer adm"}
        )
        assert "rollout_id" in assert_error(bad, 400, "invalid_request_error", retry=False)
        issued = await client.post(
            "/admin/sessions", json={"rollout_id": "r-7"}, headers={"authorization": "Bearer adm"}
        )
        token = issued.json()["token"]
        counted = await client.post(
            "/v1/messages/count_tokens", json=body("hi"), headers={"authorization": f"Bearer {token}"}
        )
        assert counted.status_code == 200
        closed = await client.post("/admin/sessions/r-7/close", headers={"authorization": "Bearer adm"})
        assert closed.status_code == 404  # no turn ever ran, so there is no session to close
        after = await client.post("/v1/messages/count_tokens", json=body("hi"), headers={"x-api-key": token})
        assert_error(after, 401, "authentication_error", retry=False)


async def test_admin_api_is_off_without_admin_token() -> None:
    async with adapter_client(settings(DEAD_ENGINE), BusPublisher()) as client:
        response = await client.post("/admin/sessions", json={"rollout_id": "r"})
        assert_error(response, 403, "permission_error", retry=False)


MALFORMED = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    (json.dumps({"model": "m", "max_tokens": 5}).encode(), "messages: Field required"),
    (json.dumps(body("hi", max_tokens="5")).encode(), "max_tokens"),
    (json.dumps(body("hi", max_tokens=0)).encode(), "max_tokens"),
    (json.dumps(body([])).encode(), "messages"),
    (json.dumps(body([{"role": "robot", "content": "x"}])).encode(), "messages.0.role"),
    (json.dumps(body([{"role": "user", "content": [{"type": "video"}]}])).encode(), "messages.0.content"),
    (
        json.dumps(body([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])).encode(),
        "prefill",
    ),
    (
        json.dumps(
            body(
                [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "out"}],
                    }
                ]
            )
        ).encode(),
        "does not answer a tool_use",
    ),
    (
        json.dumps(
            body(
                [
                    {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                    {"role": "user", "content": "x"},
                ]
            )
        ).encode(),
        "not allowed in assistant",
    ),
    (json.dumps(body("hi", tools=[READ_TOOL, READ_TOOL])).encode(), "repeated: Read"),
    (json.dumps(body("hi", tools=[{**READ_TOOL, "name": "bad name!"}])).encode(), "tools.0.name"),
    (json.dumps(body("hi", temperature=7)).encode(), "temperature"),
    (json.dumps(body("hi", system=[{"type": "image"}])).encode(), "system"),
]


@pytest.mark.parametrize("raw, fragment", MALFORMED)
async def test_malformed_bodies_are_400_with_a_reason(raw: bytes, fragment: str) -> None:
    async with adapter_client(settings(DEAD_ENGINE), BusPublisher()) as client:
        response = await client.post(
            "/v1/messages", content=raw, headers={**KEY, "content-type": "application/json"}
        )
        assert fragment in assert_error(response, 400, "invalid_request_error", retry=False)


async def test_body_over_the_limit_is_413_declared_or_streamed() -> None:
    async with adapter_client(settings(DEAD_ENGINE, body_limit=2000), BusPublisher()) as client:
        big = json.dumps(body("x" * 5000)).encode()
        declared = await client.post("/v1/messages", content=big, headers=KEY)
        assert_error(declared, 413, "request_too_large", retry=False)

        async def chunks():
            for i in range(0, len(big), 500):
                yield big[i : i + 500]

        streamed = await client.post("/v1/messages", content=chunks(), headers=KEY)
        assert_error(streamed, 413, "request_too_large", retry=False)


async def test_unknown_routes_and_methods_answer_in_anthropic_shape() -> None:
    async with adapter_client(settings(DEAD_ENGINE), BusPublisher()) as client:
        assert_error(await client.post("/v1/complete", json={}), 404, "not_found_error", retry=False)
        assert_error(await client.get("/v1/messages"), 405, "invalid_request_error", retry=False)


async def test_count_tokens_counts_the_rendered_prompt() -> None:
    tokenizer = load_tokenizer("qwen3.6")
    async with adapter_client(settings(DEAD_ENGINE), BusPublisher()) as client:
        short = await client.post("/v1/messages/count_tokens?beta=true", json=body("hello"), headers=KEY)
        longer = await client.post("/v1/messages/count_tokens", json=body("hello " * 50), headers=KEY)
    messages = [
        {"role": "system", "content": "You are Claude Code, a coding agent.\n\nWork in /repo."},
        {"role": "user", "content": "hello"},
    ]
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in body("x")["tools"]
    ]
    expected = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert short.json() == {"input_tokens": len(tokenizer.encode(expected, add_special_tokens=False))}
    assert longer.json()["input_tokens"] - short.json()["input_tokens"] >= 50


async def test_prompt_over_the_context_is_the_400_the_cli_compacts_on() -> None:
    async with adapter_client(settings(DEAD_ENGINE, context_length=600), BusPublisher()) as client:
        request = body("word " * 800)
        count = (await client.post("/v1/messages/count_tokens", json=request, headers=KEY)).json()
        response = await client.post("/v1/messages", json=request, headers=KEY)
    message = assert_error(response, 400, "invalid_request_error", retry=False)
    assert message == f"prompt is too long: {count['input_tokens']} tokens > 600 maximum"


async def test_engine_down_is_a_retryable_500_and_nothing_is_published() -> None:
    publisher = BusPublisher()
    async with adapter_client(settings(DEAD_ENGINE), publisher) as client:
        plain = await client.post("/v1/messages", json=body("hi", stream=False), headers=KEY)
        assert_error(plain, 500, "api_error", retry=True)
        streamed = await client.post("/v1/messages", json=body("hi"), headers=KEY)
    assert streamed.status_code == 200
    names = [name for name, _ in sse_events(streamed.text)]
    assert names[0] == "message_start" and names[-1] == "error"
    assert publisher.events == []


async def test_concurrency_limit_is_529_and_cancel_aborts_on_the_engine() -> None:
    async with StalledEngine() as engine:
        async with adapter_client(settings(engine.url, max_concurrency=1), BusPublisher()) as client:
            first = asyncio.create_task(
                client.post("/v1/messages", json=body("one", stream=False), headers=KEY)
            )
            while engine.generating == 0:
                await asyncio.sleep(0.02)
            second = await client.post("/v1/messages", json=body("two"), headers={"x-api-key": "other"})
            message = assert_error(second, 529, "overloaded_error", retry=True)
            assert "limit 1" in message and int(second.headers["retry-after"]) >= 1
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            while not engine.aborted:
                await asyncio.sleep(0.02)
            assert engine.aborted[0].startswith("rb-")
            assert client.app.state.adapter.active == 0


async def test_draining_refuses_new_turns_with_503() -> None:
    async with adapter_client(settings(DEAD_ENGINE), BusPublisher()) as client:
        assert await client.app.state.adapter.drain(timeout=1.0)
        response = await client.post("/v1/messages", json=body("hi"), headers=KEY)
        assert_error(response, 503, "api_error", retry=True)
        assert "retry-after" in response.headers
        assert (await client.get("/healthz")).status_code == 503


async def test_slow_generation_streams_pings_and_a_hang_up_aborts_it() -> None:
    async with StalledEngine() as engine:
        app = create_app(settings(engine.url), BusPublisher())
        async with served(app) as (url, _), httpx.AsyncClient(base_url=url, timeout=30) as client:
            names = []
            async with client.stream("POST", "/v1/messages", json=body("slow"), headers=KEY) as response:
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        names.append(line.removeprefix("event: "))
                    if names.count("ping") == 2:
                        break  # leaving the block hangs up mid-generation
            assert names == ["message_start", "ping", "ping"]
            while not engine.aborted:
                await asyncio.sleep(0.02)
            while app.state.adapter.active:
                await asyncio.sleep(0.02)


async def test_sigterm_drains_in_flight_turns_and_refuses_late_ones() -> None:
    tokenizer = load_tokenizer("qwen3.6")
    answer = tokenizer.encode("\n</think>\n\nAll done.<|im_end|>", add_special_tokens=False)
    publisher = BusPublisher()
    # uvicorn re-raises the signal after it stops: let that land on a harmless handler, not on pytest
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        async with StalledEngine(answer) as engine:
            app = create_app(settings(engine.url), publisher)

            def drain_on_signal(server) -> None:
                install_drain(server, app.state.adapter, timeout=30)

            async with (
                served(app, drain_on_signal) as (url, server),
                httpx.AsyncClient(base_url=url) as client,
            ):
                request = client.post("/v1/messages", json=body("x", stream=False), headers=KEY, timeout=30)
                in_flight = asyncio.create_task(request)
                while engine.generating == 0:
                    await asyncio.sleep(0.02)
                os.kill(os.getpid(), signal.SIGTERM)
                while not app.state.adapter.draining:
                    await asyncio.sleep(0.02)
                late = await client.post("/v1/messages", json=body("late"), headers={"x-api-key": "late"})
                assert_error(late, 503, "api_error", retry=True)
                assert not server.should_exit  # still serving: a turn is in flight
                engine.release()
                finished = await in_flight
                assert finished.status_code == 200 and finished.json()["content"][-1]["text"] == "All done."
                while not server.should_exit:
                    await asyncio.sleep(0.02)
    finally:
        signal.signal(signal.SIGTERM, previous)
    (turn,) = publisher.of("turns", KEY["x-api-key"])
    assert turn["output_ids"] == answer and turn["policy_version"] == 3
