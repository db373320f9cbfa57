"""The engine as a sandboxed agent would attack it, and the costs that must not grow without bound."""

from __future__ import annotations

import json

import pytest

from rollbus.services.engine.policies import ChainRoute, SamplePolicy, ScriptedPolicy
from rollbus.services.engine.protocol import IncrementalText
from tests.test_adapter_protocol import KEY
from tests.test_adapter_support import BusPublisher, StalledEngine, adapter_client, body, settings
from tests.test_engine import SCRIPT, chat_prompt, make_engine, serving

SECRET = "engine-key-never-in-a-sandbox"
CONTROL = [
    ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/workspace/evil"}),
    ("POST", "/abort_request", {"abort_all": True}),
    ("POST", "/flush_cache", None),
    ("GET", "/get_server_info", None),
    ("GET", "/metrics", None),
]


@pytest.fixture(scope="module")
def keyed(tokenizer):  # noqa: F811
    engine = make_engine(tokenizer, ScriptedPolicy(SCRIPT))
    with serving(engine, api_key=SECRET) as client:
        yield engine, client


@pytest.mark.parametrize("method, path, payload", CONTROL)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {SECRET}", SECRET, f"Bearer {SECRET}x"])
def test_every_route_but_health_wants_the_key(keyed, method, path, payload, auth) -> None:
    engine, client = keyed
    headers = {"authorization": auth} if auth else {}
    version = engine.weight_version
    response = client.request(method, path, json=payload, headers=headers)
    assert response.status_code == 401, (path, response.text)
    assert engine.weight_version == version


def test_with_the_key_the_engine_serves_and_health_needs_none(keyed, tokenizer) -> None:  # noqa: F811
    _, client = keyed
    assert client.get("/health").status_code == 200
    body = {"input_ids": chat_prompt(tokenizer, "hi"), "sampling_params": {"max_new_tokens": 2}}
    ok = client.post("/generate", json=body, headers={"authorization": f"Bearer {SECRET}"})
    assert ok.status_code == 200, ok.text


async def test_the_adapter_sends_the_key_on_generate_and_abort() -> None:
    async with StalledEngine([9707], released=True) as engine:
        async with adapter_client(settings(engine.url, engine_api_key=SECRET), BusPublisher()) as client:
            response = await client.post("/v1/messages", json=body("hi", stream=False), headers=KEY)
        assert response.status_code == 200, response.text
    assert engine.headers and all(h["authorization"] == f"Bearer {SECRET}" for h in engine.headers)
    assert SECRET not in repr(settings(engine.url, engine_api_key=SECRET))


def test_streamed_text_is_decoded_once_per_token(tokenizer) -> None:  # noqa: F811
    """The stream's text grows by the new tokens only; the work is linear in the output length."""
    engine = make_engine(tokenizer, SamplePolicy())
    decoded: list[int] = []
    real_decode = engine.tokenizer.decode

    def counting_decode(ids, **kwargs):
        decoded.append(len(ids))
        return real_decode(ids, **kwargs)

    engine.tokenizer.decode = counting_decode
    try:
        request = {
            "input_ids": chat_prompt(tokenizer, "count"),
            "sampling_params": {"max_new_tokens": 120, "ignore_eos": True, "temperature": 0.0},
            "stream": True,
        }
        with serving(engine) as client, client.stream("POST", "/generate", json=request) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
    finally:
        engine.tokenizer.decode = real_decode
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    final = events[-1]
    n = len(final["output_ids"])
    assert n > 50
    assert sum(decoded) <= 3 * n, f"{sum(decoded)} ids decoded for {n} output tokens"
    for event in events[:-1]:
        assert final["text"].startswith(event["text"])


def test_incremental_text_waits_for_split_characters(tokenizer) -> None:  # noqa: F811
    text = "héllo 🙂 wörld, 日本語のテキスト"
    ids = tokenizer.encode(text, add_special_tokens=False)
    incremental = IncrementalText(lambda part: tokenizer.decode(part))
    seen = [incremental.feed(ids[: i + 1]) for i in range(len(ids))]
    assert seen[-1] == text
    assert all("\ufffd" not in piece and text.startswith(piece) for piece in seen)


def test_scripted_cursors_are_bounded_and_the_recent_ones_kept() -> None:
    policy = ScriptedPolicy(SCRIPT, max_cursors=3)
    first = policy.scripted_turn(ChainRoute("r-0", "main", "main"))
    for i in range(1, 50):
        policy.scripted_turn(ChainRoute(f"r-{i}", "main", "main"))
        policy.scripted_turn(ChainRoute("r-0", "main", "main"))  # r-0 stays recent
    assert len(policy.cursors) == 3
    assert policy.cursors[("r-0", "main", "main")] == 50
    assert first == SCRIPT.turns[0]
