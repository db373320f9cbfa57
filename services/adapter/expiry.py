"""Idle session expiry: a rollout whose runner vanished without closing it must not hold memory forever.

A session idle for ``--session-idle-timeout`` seconds (no request, no turn in flight) is closed as the
admin close would: its live chains get ``closed`` events (reason ``idle_timeout``) and its token stops
working. Tokens issued but never used expire the same way. A background task owned by the app's
lifespan checks a few times per timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from rollbus.services.adapter.state import AdapterState
from rollbus.services.adapter.turn import close_chains

log = logging.getLogger(__name__)

TASK_NAME = "rollbus-adapter-idle-expiry"
MAX_CHECK_INTERVAL = 60.0  # seconds; an expiry is at most this late (a quarter of the timeout if less)


async def expire_idle(state: AdapterState) -> list[str]:
    """Close every session idle for longer than the timeout; returns their rollout ids.

    All their tokens are revoked before the first ``await``, so no request can reopen one meanwhile.
    """
    timeout = state.kit.settings.session_idle_timeout
    sessions = state.sessions.expire(state.sessions.clock() - timeout)
    unused = state.tokens.unused(state.tokens.clock() - timeout, state.sessions)
    expired = [s.rollout_id for s in sessions] + unused
    for rollout_id in expired:
        state.tokens.revoke(rollout_id)
    for session in sessions:
        chains = close_chains(state.kit, session.agents.values(), reason="idle_timeout")
        log.info("rollout %s was idle: closed its chains %s", session.rollout_id, chains)
    return expired


@contextlib.asynccontextmanager
async def idle_expiry(state: AdapterState) -> AsyncIterator[None]:
    """Expire idle sessions in the background for the life of the block (never if the timeout is 0)."""
    if not state.kit.settings.session_idle_timeout:
        yield
        return
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_idle(state, stop), name=TASK_NAME)
    try:
        yield
    finally:
        stop.set()
        await watcher


async def watch_idle(state: AdapterState, stop: asyncio.Event) -> None:
    """Run :func:`expire_idle` until ``stop`` is set (by the lifespan, at shutdown).

    Stopping is not cancelling: a sweep under way finishes, so the ``closed`` events of the sessions it
    removed reach the outbox, which the shutdown then flushes.
    """
    interval = min(state.kit.settings.session_idle_timeout / 4, MAX_CHECK_INTERVAL)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            await expire_idle(state)
