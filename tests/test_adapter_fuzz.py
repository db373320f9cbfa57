"""Property tests of the request parser: no body, however broken, may turn into a 500."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbus.services.adapter.anthropic import parse_messages_request
from rollbus.services.adapter.app import create_app
from rollbus.services.adapter.canonical import TemplateRenderer
from rollbus.services.adapter.errors import ApiError
from rollbus.services.adapter.translate import to_chat
from rollbus.tokenizer import load_tokenizer
from tests.test_adapter_support import BusPublisher, StalledEngine, body, free_port
from tests.test_adapter_support import settings as adapter_settings


def nested(depth: int, leaf: Any) -> Any:
    for i in range(depth):
        leaf = {"a": leaf} if i % 2 else [leaf]
    return leaf


huge_integers = st.integers(min_value=2**31).map(lambda n: n * 10**30) | st.integers(-(10**40), -(2**31))
lone_surrogates = st.sampled_from(["\ud800", "a\udfff", "\udbff\u0041", "x\ud83d"])  # json.dumps escapes them
deeply_nested = st.integers(60, 700).map(lambda depth: nested(depth, "x"))
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | huge_integers
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | lone_surrogates,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4) | deeply_nested
    ),
    max_leaves=20,
)

VALID = body(
    [
        {"role": "user", "content": "Read app.py"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "read it", "signature": ""},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a"}},
            ],
        },
        {"role": "system", "content": "The date changed."},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "x=1"}],
                    "is_error": False,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "text", "text": "go on"},
            ],
        },
    ],
    temperature=1.0,
)
KEYS = [
    "model",
    "max_tokens",
    "system",
    "tools",
    "messages",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "type",
    "text",
    "content",
    "role",
    "id",
    "name",
    "input",
    "tool_use_id",
    "is_error",
    "thinking",
    "signature",
    "input_schema",
    "description",
]


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (keys and list indexes)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, prefix + (key,))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += paths(item, prefix + (i,))
    return found


ALL_PATHS = paths(VALID)[1:]


@st.composite
def mutated_bodies(draw) -> dict[str, Any]:
    """The valid body with a few parts deleted, replaced by random JSON, or given a stray key."""
    data = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(ALL_PATHS))
        parent = data
        try:
            for step in path[:-1]:
                parent = parent[step]
            op = draw(st.sampled_from(["delete", "replace", "add"]))
            if op == "delete":
                del parent[path[-1]]
            elif op == "replace":
                parent[path[-1]] = draw(json_values)
            elif isinstance(parent, dict):
                parent[draw(st.sampled_from(KEYS))] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path
    return data


_renderer = TemplateRenderer(load_tokenizer("qwen3.6"))


def check_parses_or_400(raw: bytes) -> None:
    """A 400 ApiError, or a request that translates and renders with the real chat template."""
    try:
        request = parse_messages_request(raw)
    except ApiError as err:
        assert err.status == 400 and err.error_type == "invalid_request_error" and err.message
        return
    chat = to_chat(request.system, request.messages, request.tools)
    assert _renderer.full(chat.messages, chat.tools or None)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_random_json_is_a_clean_400(value) -> None:
    check_parses_or_400(json.dumps(value).encode())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_bodies())
def test_mutated_cli_bodies_parse_or_are_400(data) -> None:
    check_parses_or_400(json.dumps(data).encode())


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_a_clean_400(raw) -> None:
    check_parses_or_400(raw)


HEADERS = {"x-api-key": "fuzz", "content-type": "application/json"}


def test_through_the_app_every_mutation_is_a_4xx() -> None:
    """With a one-token context every valid body is 'prompt is too long', so any 5xx is a parser bug."""
    app = create_app(adapter_settings(f"http://127.0.0.1:{free_port()}", context_length=1), BusPublisher())
    loop = asyncio.new_event_loop()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://adapter")
    statuses: list[int] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutated_bodies())
    def post(data) -> None:
        response = loop.run_until_complete(
            client.post("/v1/messages", content=json.dumps(data).encode(), headers=HEADERS)
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        statuses.append(response.status_code)

    try:
        post()
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    assert statuses


def test_bodies_that_reach_the_engine_are_answered_or_400() -> None:
    """A real context and an engine that answers at once: what parses is rendered, sampled, parsed and
    recorded; a body the adapter or the engine refuses is a 400. Nothing is a 5xx."""
    loop = asyncio.new_event_loop()
    engine = StalledEngine([9707, 13], released=True)
    loop.run_until_complete(engine.__aenter__())
    publisher = BusPublisher()
    app = create_app(adapter_settings(engine.url, context_length=8192), publisher)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://adapter")
    statuses: list[int] = []

    @settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mutated_bodies(), st.sampled_from([None, True, False]))
    def post(data, stream) -> None:
        if stream is not None and isinstance(data, dict):
            data["stream"] = stream
        response = loop.run_until_complete(
            client.post("/v1/messages", content=json.dumps(data).encode(), headers=HEADERS)
        )
        assert response.status_code in (200, 400), response.text
        if response.status_code == 400:
            assert response.json()["error"]["type"] == "invalid_request_error"
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert "event: error" not in response.text, response.text
        statuses.append(response.status_code)

    try:
        post()
    finally:
        loop.run_until_complete(client.aclose())
        loop.run_until_complete(engine.__aexit__())
        loop.close()
    assert 200 in statuses and 400 in statuses
    assert len(engine.bodies) == statuses.count(200)
