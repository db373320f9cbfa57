"""The runner's client of the adapter's sessions API over a real HTTP server: a new attempt waits for an
adapter that is restarting (its port closed) instead of failing at once, and past ``--adapter-wait`` fails
as ``session_failed``. The adapter is stood in by a small app answering the two admin routes: only the
waiting is under test, not the adapter's sessions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollbus.kafka.broker import free_port
from rollbus.services.sandbox_runner.outcome import SESSION_FAILED
from rollbus.services.sandbox_runner.rollout import AdapterSessions, AttemptFailed


async def open_session(request: Request) -> JSONResponse:
    body = await request.json()
    return JSONResponse({"token": f"token-{body['attempt_id']}"})


async def close_session(request: Request) -> JSONResponse:
    return JSONResponse({}, status_code=404)


ROUTES = [
    Route("/admin/sessions", open_session, methods=["POST"]),
    Route("/admin/sessions/{rollout}/close", close_session, methods=["POST"]),
]
APP = Starlette(routes=ROUTES)


@contextlib.asynccontextmanager
async def adapter_on(port: int) -> AsyncIterator[None]:
    server = uvicorn.Server(uvicorn.Config(APP, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        yield
    finally:
        server.should_exit = True
        await task


async def test_a_new_attempt_waits_for_a_restarting_adapter(caplog: pytest.LogCaptureFixture) -> None:
    """Before, an attempt started while the adapter was down failed as session_failed within ~2 s."""
    port = free_port()
    sessions = AdapterSessions(f"http://127.0.0.1:{port}", "adm", timeout=10.0, wait=300.0)
    try:
        with caplog.at_level(logging.WARNING, logger="rollbus.sandbox_runner"):
            opening = asyncio.create_task(sessions.open("r1", "r1-a1"))
            async with asyncio.timeout(120):  # the client found the port closed, tried again, and waits
                while "waiting for it" not in caplog.text:
                    assert not opening.done(), opening
                    await asyncio.sleep(0.05)
        async with adapter_on(port):
            token = await asyncio.wait_for(opening, 120)
    finally:
        await sessions.aclose()
    assert token == "token-r1-a1"


async def test_past_its_wait_an_attempt_fails_as_session_failed() -> None:
    sessions = AdapterSessions(f"http://127.0.0.1:{free_port()}", "adm", timeout=10.0, wait=0.0)
    try:
        with pytest.raises(AttemptFailed) as failed:
            await sessions.open("r2", "r2-a1")
    finally:
        await sessions.aclose()
    assert failed.value.kind == SESSION_FAILED and "adapter unreachable" in str(failed.value)
