"""What every request passes before the adapter looks at it: the body limit and the session token."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from rollbus.services.adapter.errors import (
    ClientGone,
    body_timed_out,
    forbidden,
    invalid_request,
    too_large,
    unauthenticated,
)
from rollbus.services.adapter.sessions import AGENT_PEER, PEER_HEADER, ROUTES, TOOL_PEER
from rollbus.services.adapter.tokens import Grant, SessionTokens


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes, and with 408 if it
    has not arrived in full after ``timeout`` seconds (a client that sends less than its
    ``content-length`` would otherwise hold the request until it gives up)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit() or len(declared) > 20:
            raise invalid_request("content-length must be a number")
        if int(declared) > limit:
            raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise body_timed_out(timeout, size, declared) from None
    except ClientDisconnect:
        raise ClientGone("client disconnected while sending its body") from None
    return b"".join(chunks)


def bearer_or_key(request: Request) -> str | None:
    """``x-api-key`` (ANTHROPIC_API_KEY) or ``Authorization: Bearer`` (ANTHROPIC_AUTH_TOKEN)."""
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return None


def grant(request: Request, tokens: SessionTokens, harness: str) -> Grant:
    """The rollout (and attempt) the request's session token admits on the route of ``harness`` (any harness
    whose token opens that route, :data:`ROUTES`); 401 for none, a bad or a closed one, 403 for a token of a
    harness on another route (a Claude Code rollout's token on the OpenAI route would open a conversation
    its CLI never had)."""
    token = bearer_or_key(request)
    if token is None:
        raise unauthenticated("missing session token: send x-api-key or Authorization: Bearer")
    granted = tokens.verify(token)
    if granted is None:
        raise unauthenticated("unknown session token (or its rollout was closed)")
    if granted.harness is not None and ROUTES.get(granted.harness) != ROUTES[harness]:
        opens = ROUTES.get(granted.harness, "no route")
        raise forbidden(f"this session token is a {granted.harness} rollout's: it opens {opens} only")
    return granted


def peer(request: Request) -> str | None:
    """Who in the sandbox sent the request, as the adapter proxy says (None: a host-side caller)."""
    said = request.headers.get(PEER_HEADER)
    if said is None or said in (AGENT_PEER, TOOL_PEER):
        return said
    raise invalid_request(f"{PEER_HEADER}: {AGENT_PEER!r} or {TOOL_PEER!r} expected")
