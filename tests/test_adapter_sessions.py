"""Session tokens and the life of a session, tried as the policy would: forged, replayed after a close,
raced against the close, and a rollout reopened as a new attempt."""

from __future__ import annotations

import asyncio
import json

from rollbus.services.adapter.tokens import SessionTokens
from tests.test_adapter_protocol import assert_error
from tests.test_adapter_support import BusPublisher, StalledEngine, adapter_client, body, settings

ADMIN = {"authorization": "Bearer adm"}
KEY = b"k" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def test_tokens_are_signed_and_survive_a_restart() -> None:
    clock = Clock()
    tokens = SessionTokens(KEY, clock=clock)
    token = tokens.issue("r-1", "attempt-2")
    restarted = SessionTokens(KEY, clock=clock)
    grant = restarted.verify(token)
    assert grant is not None and (grant.rollout_id, grant.attempt_id) == ("r-1", "attempt-2")
    assert SessionTokens(b"other-key" * 4, clock=clock).verify(token) is None
    prefix, payload, mac = token.split(".")
    forged = json.dumps(["r-other", "attempt-2", clock.now])
    import base64

    assert restarted.verify(f"{prefix}.{base64.urlsafe_b64encode(forged.encode()).decode()}.{mac}") is None
    assert restarted.verify(token[:-1] + ("0" if token[-1] != "0" else "1")) is None
    for junk in ("", "rb1", "rb1..", "rb1.!!!.x", "x" * 10_000, "rb1.e30." + mac):
        assert restarted.verify(junk) is None
    clock.now += 8 * 24 * 3600
    assert restarted.verify(token) is None  # past its ttl


def test_a_closed_rollout_refuses_its_old_tokens_and_a_reopen_gets_new_ones() -> None:
    clock = Clock()
    tokens = SessionTokens(KEY, clock=clock)
    old = tokens.issue("r-1")
    clock.now += 1
    tokens.revoke("r-1")
    assert tokens.verify(old) is None
    new = tokens.issue("r-1", "attempt-2")  # at the very instant of the close: still a new token
    assert tokens.verify(new) is not None and tokens.verify(old) is None
    dev = SessionTokens(KEY, open_sessions=True, clock=clock)
    assert dev.rollout_for("r-dev") == "r-dev"
    dev.revoke("r-dev")
    assert dev.rollout_for("r-dev") is None


def test_closed_records_are_pruned_after_the_token_ttl() -> None:
    clock = Clock()
    tokens = SessionTokens(KEY, clock=clock, ttl=100)
    for n in range(50):
        tokens.revoke(f"r-{n}")
    clock.now += 101
    tokens.revoke("r-last")
    assert [r for r in ("r-0", "r-49", "r-last") if tokens.is_closed(r)] == ["r-last"]


async def open_session(client, rollout: str, attempt: str | None = None) -> dict[str, str]:
    payload = {"rollout_id": rollout} | ({"attempt_id": attempt} if attempt else {})
    response = await client.post("/admin/sessions", json=payload, headers=ADMIN)
    assert response.status_code == 200, response.text
    return {"x-api-key": response.json()["token"]}


async def test_a_turn_generating_when_its_session_closes_is_not_recorded() -> None:
    publisher = BusPublisher()
    async with StalledEngine([9707], released=True) as engine:
        config = settings(engine.url, open_sessions=False, admin_token="adm")
        async with adapter_client(config, publisher) as client:
            headers = await open_session(client, "r-close", "att-1")
            first = await client.post("/v1/messages", json=body("hi", stream=False), headers=headers)
            assert first.status_code == 200, first.text
            engine.hold()
            second = asyncio.create_task(
                client.post("/v1/messages", json=body("again", stream=False), headers=headers)
            )
            while engine.generating < 2:
                await asyncio.sleep(0.02)
            closed = await client.post("/admin/sessions/r-close/close", headers=ADMIN)
            assert closed.json()["closed"] == ["main"]
            engine.release()
            assert_error(await second, 401, "authentication_error", retry=False)
            late = await client.post("/v1/messages", json=body("hi", stream=False), headers=headers)
            assert "closed" in assert_error(late, 401, "authentication_error", retry=False)
    events = [(t, r.get("kind"), r["attempt_id"]) for t, _, r in publisher.events]
    assert events == [
        ("sessions", "opened", "att-1"),
        ("turns", None, "att-1"),
        ("sessions", "closed", "att-1"),
    ]


async def test_a_close_during_the_body_upload_does_not_start_a_new_chain() -> None:
    publisher = BusPublisher()
    async with adapter_client(
        settings("http://127.0.0.1:9", open_sessions=False, admin_token="adm"), publisher
    ) as client:
        headers = await open_session(client, "r-race")
        raw = json.dumps(body("hi", stream=False)).encode()
        uploading = asyncio.Event()
        closing = asyncio.Event()

        async def slow_body():
            yield raw[:100]
            uploading.set()
            await closing.wait()
            yield raw[100:]

        request = asyncio.create_task(client.post("/v1/messages", content=slow_body(), headers=headers))
        await uploading.wait()
        await asyncio.sleep(0.05)
        await client.post("/admin/sessions/r-race/close", headers=ADMIN)
        closing.set()
        assert_error(await request, 401, "authentication_error", retry=False)
        assert "r-race" not in client.app.state.adapter.sessions
    assert publisher.events == []


async def test_a_new_attempt_never_lands_in_the_session_an_earlier_attempt_left_open() -> None:
    """The runner of attempt 1 died without closing its session (or its close was lost); attempt 2's token
    ends that session: its chain is closed, its token refused, and attempt 2's turns name attempt 2."""
    publisher = BusPublisher()
    async with StalledEngine([9707], released=True) as engine:
        config = settings(engine.url, open_sessions=False, admin_token="adm")
        async with adapter_client(config, publisher) as client:
            killed = await open_session(client, "r-rerun", "att-1")
            first = await client.post("/v1/messages", json=body("hi", stream=False), headers=killed)
            assert first.status_code == 200, first.text
            await open_session(client, "r-rerun", "att-1")  # the same attempt again: its session stays
            assert "r-rerun" in client.app.state.adapter.sessions
            rerun = await open_session(client, "r-rerun", "att-2")
            second = await client.post("/v1/messages", json=body("hi", stream=False), headers=rerun)
            assert second.status_code == 200, second.text
            stale = await client.post("/v1/messages", json=body("hi", stream=False), headers=killed)
            assert_error(stale, 401, "authentication_error", retry=False)
    events = [(t, r.get("kind"), r["attempt_id"]) for t, _, r in publisher.events]
    assert events == [
        ("sessions", "opened", "att-1"),
        ("turns", None, "att-1"),
        ("sessions", "closed", "att-1"),
        ("sessions", "opened", "att-2"),
        ("turns", None, "att-2"),
    ]
