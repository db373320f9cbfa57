"""The adapter's HTTP surface: one route per wire protocol (:data:`PROTOCOLS`, each served by
:func:`rollbus.services.adapter.wire.endpoint`), Anthropic's ``count_tokens``, admin, health and metrics.
Routes only; the work is in :mod:`rollbus.services.adapter.turn`."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rollbus.services.adapter import anthropic, edge
from rollbus.services.adapter.bodies import decode_json
from rollbus.services.adapter.engine_http import EngineHTTP
from rollbus.services.adapter.errors import ApiError, forbidden, invalid_request, not_found, unauthenticated
from rollbus.services.adapter.expiry import idle_expiry
from rollbus.services.adapter.markup import ContentFormsMarkup
from rollbus.services.adapter.messages import Messages
from rollbus.services.adapter.metrics import CountRequests
from rollbus.services.adapter.openai import ChatCompletions
from rollbus.services.adapter.publisher import BytePublisher
from rollbus.services.adapter.replies import ClientGone
from rollbus.services.adapter.responses import Responses
from rollbus.services.adapter.restore import Records, load, restore
from rollbus.services.adapter.sessions import CLAUDE_CODE, HARNESSES
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.state import AdapterState, build_state, shutdown, warm_up
from rollbus.services.adapter.translate import to_chat
from rollbus.services.adapter.turn import close_chains
from rollbus.services.adapter.wire import WireProtocol, route

log = logging.getLogger(__name__)
#: every wire protocol the adapter serves, by route; a route outside it (count_tokens, admin, a 404) answers
#: errors in Anthropic's shape, the default
PROTOCOLS: dict[str, WireProtocol[Any]] = {p.path: p for p in (Messages(), ChatCompletions(), Responses())}
DEFAULT_PROTOCOL = PROTOCOLS[Messages.path]


async def count_tokens(request: Request) -> Response:
    state: AdapterState = request.app.state.adapter
    edge.grant(request, state.tokens, CLAUDE_CODE)
    body = anthropic.parse_count_tokens_request(
        await edge.read_body(request, state.kit.settings.body_limit, state.kit.settings.body_timeout)
    )
    chat = to_chat(body.system, body.messages, body.tools)
    try:
        ids = await asyncio.to_thread(state.renderer.full, chat.messages, chat.tools or None)
    except ContentFormsMarkup as exc:
        raise invalid_request(str(exc)) from None
    return JSONResponse({"input_tokens": len(ids)})


async def open_session(request: Request) -> Response:
    """``{rollout_id}`` -> ``{token}``: the runner gives the token to the agent as its API key."""
    state: AdapterState = request.app.state.adapter
    settings = state.kit.settings
    _check_admin(request, settings)
    body = await edge.read_body(request, settings.admin_body_limit, settings.body_timeout)
    data = decode_json(body)
    rollout, attempt = data.get("rollout_id"), data.get("attempt_id", "")
    if not isinstance(rollout, str) or not rollout:
        raise invalid_request("rollout_id: a non-empty string is required")
    if not isinstance(attempt, str):
        raise invalid_request("attempt_id: a string is required if given")
    harness = data.get("harness", CLAUDE_CODE)
    if harness not in HARNESSES:
        raise invalid_request(f"harness: one of {', '.join(HARNESSES)}")
    await _end_earlier_attempt(state, rollout, attempt)
    token = state.tokens.issue(rollout, attempt, harness)
    return JSONResponse({"rollout_id": rollout, "attempt_id": attempt, "harness": harness, "token": token})


async def _end_earlier_attempt(state: AdapterState, rollout: str, attempt: str) -> None:
    """A new attempt ends what an earlier attempt of the rollout left live (its runner died, or its close
    was lost): its chains close and its tokens stop working. Sessions are keyed by rollout, so otherwise
    the new attempt's requests would land in that session, be recorded under the dead attempt's id, and
    the rewarded attempt would never close: nothing of the rollout would train."""
    live = state.sessions.peek(rollout)
    if live is None or live.attempt_id == attempt:
        return
    state.tokens.revoke(rollout)
    state.sessions.pop(rollout)
    close_chains(state.kit, live.agents.values(), reason="superseded")
    await state.kit.outbox.settled(state.kit.settings.publish_wait)


async def close_session(request: Request) -> Response:
    """The rollout ended: its live chains are closed on the bus and its token stops working."""
    state: AdapterState = request.app.state.adapter
    _check_admin(request, state.kit.settings)
    rollout = request.path_params["rollout_id"]
    state.tokens.revoke(rollout)
    session = state.sessions.pop(rollout)
    if session is None:
        raise not_found(f"no session for rollout {rollout!r}")
    closed = close_chains(state.kit, session.agents.values())
    await state.kit.outbox.settled(state.kit.settings.publish_wait)
    return JSONResponse({"rollout_id": rollout, "closed": closed})


def _check_admin(request: Request, settings: AdapterSettings) -> None:
    if not settings.admin_token:
        raise forbidden("the admin API is disabled: start the adapter with --admin-token")
    token = edge.bearer_or_key(request) or ""
    if not hmac.compare_digest(token.encode(), settings.admin_token.encode()):
        raise unauthenticated("admin token required")


async def root(request: Request) -> Response:
    return Response(status_code=200)


async def healthz(request: Request) -> Response:
    state: AdapterState = request.app.state.adapter
    status = "draining" if state.draining else "ok"
    body = {"status": status, "active_turns": state.active, "bus_backlog": len(state.kit.outbox.backlog)}
    return JSONResponse(body, status_code=503 if state.draining else 200)


async def metrics(request: Request) -> Response:
    state: AdapterState = request.app.state.adapter
    return Response(generate_latest(state.kit.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def shaped(request: Request, err: ApiError) -> Response:
    """``err`` in the error shape of the wire protocol the request's route speaks, whoever raised it."""
    return PROTOCOLS.get(request.scope.get("path", ""), DEFAULT_PROTOCOL).error(err)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return shaped(request, exc)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug, in the shape the route's client understands (Starlette logs the traceback and re-raises)."""
    return shaped(request, ApiError(500, "api_error", f"internal error: {type(exc).__name__}: {exc}"))


async def client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it; the turn was aborted and not recorded


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405, in the route's error shape."""
    assert isinstance(exc, HTTPException)
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    err = ApiError(
        exc.status_code, kinds.get(exc.status_code, "api_error"), str(exc.detail), should_retry=False
    )
    return shaped(request, err)


ROUTES: list[tuple[str, Callable[[Request], Any], list[str]]] = [
    ("/", root, ["GET", "HEAD"]),
    ("/healthz", healthz, ["GET"]),
    ("/metrics", metrics, ["GET"]),
    *((path, route(protocol), ["POST"]) for path, protocol in PROTOCOLS.items()),
    ("/v1/messages/count_tokens", count_tokens, ["POST"]),
    ("/admin/sessions", open_session, ["POST"]),
    ("/admin/sessions/{rollout_id}/close", close_session, ["POST"]),
]


async def rebuild(state: AdapterState, records: Records) -> None:
    """Open rollouts from the bus (after the spilled records reached it, so it is complete)."""
    settings = state.kit.settings
    await state.kit.outbox.flush(settings.drain_timeout)
    started = time.perf_counter()
    bus = await load(records, settings.topic_namespace)
    count = restore(state, bus)
    log.info("rebuilt %d open rollouts from the bus in %.2f s", count, time.perf_counter() - started)


def create_app(
    settings: AdapterSettings,
    publisher: BytePublisher,
    *,
    tokenizer: Any = None,
    http: EngineHTTP | None = None,
    parse: Callable[..., Any] | None = None,
    records: Records | None = None,
) -> FastAPI:
    """The adapter app; without ``tokenizer``/``parse`` the real ones are loaded.

    ``publisher`` is ``rollbus.kafka.bus.Publisher`` (started by the caller) or any :class:`BytePublisher`; an
    ``http`` client passed in stays the caller's to close. With ``records`` (a reader of the bus, see
    :mod:`rollbus.services.adapter.restore`) the open rollouts are rebuilt from the bus at start.
    """
    state = build_state(settings, publisher, tokenizer=tokenizer, http=http, parse=parse)
    owned_http = http is None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await asyncio.to_thread(warm_up, state)
        recovered = state.kit.outbox.recover()  # what an earlier run could not deliver goes first
        if recovered:
            log.info("queued %d records an earlier run spilled", recovered)
        if records is not None:
            await rebuild(state, records)
        async with idle_expiry(state):
            yield
        await shutdown(state, close_http=owned_http)

    app = FastAPI(
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        middleware=[Middleware(CountRequests, metrics=state.kit.metrics)],
    )
    for path, endpoint, methods in ROUTES:
        app.add_api_route(path, endpoint, methods=methods, include_in_schema=False)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal_error)
    app.state.adapter = state
    return app
