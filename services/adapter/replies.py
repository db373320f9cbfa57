"""Turn events -> HTTP: an SSE stream for ``stream: true``, one JSON message otherwise.

Either way the turn generator is closed when the reply ends or the client goes away, which cancels and
aborts a generation still running and releases the request's admission.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from rollbus.services.adapter.assistant import AssistantTurn
from rollbus.services.adapter.errors import ClientGone
from rollbus.services.adapter.turn import Done, Ping, Started, TurnEvent, TurnInput, run_turn

Events = Callable[[AsyncIterator[TurnEvent], Started], AsyncIterator[bytes]]  # a protocol's SSE for one turn
Render = Callable[[AssistantTurn], dict[str, Any]]  # a protocol's JSON body for one finished turn


async def answer(
    state: Any,
    request: Request,
    agent: Any,
    turn: TurnInput,
    *,
    stream: Events | None,
    render: Render,
) -> Response:
    """Admit the request, run its turn and reply, the same for every route: with the route's ``stream`` (an
    SSE body over the turn's events), or one JSON body ``render`` shapes. A prompt refused before the turn's
    first event is still a plain error response; the admission is released however the reply ends."""
    state.admit()
    events = run_turn(state.kit, agent, turn)
    try:
        started = await anext(events)  # the prompt is planned: a too-long prompt is still a plain 400
        if not isinstance(started, Started):
            raise RuntimeError(f"a turn began with {type(started).__name__}, not Started")
    except BaseException:
        await events.aclose()
        state.release()
        raise
    if stream is not None:
        return TurnStream(events, stream(events, started), on_close=state.release)
    try:
        return await collect(events, request, render)
    finally:
        state.release()


class TurnStream(StreamingResponse):
    """SSE for one turn (``body``, the route's events over ``events``); ``on_close`` runs however the
    response ends (finished, failed, cut)."""

    def __init__(
        self,
        events: AsyncGenerator[TurnEvent, None],
        body: AsyncIterator[bytes],
        on_close: Callable[[], None],
    ) -> None:
        self.events = events
        self.on_close = on_close
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(body, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()
            self.on_close()


async def collect(events: AsyncGenerator[TurnEvent, None], request: Request, render: Render) -> JSONResponse:
    """Run a turn to its end for a non-streaming request, watching for the client leaving; ``render``
    shapes the finished turn in the protocol that asked."""
    try:
        async for item in events:
            if isinstance(item, Ping) and await request.is_disconnected():
                raise ClientGone("client disconnected during generation")
            if isinstance(item, Done):
                return JSONResponse(render(item.turn))
        raise RuntimeError("turn ended without a message")
    finally:
        await events.aclose()
