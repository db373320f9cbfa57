"""Session tokens: which rollout (and attempt, and harness) a request belongs to.

Tokens are HMACs of (rollout, attempt, issue time, harness) under the adapter's signing key: checked in O(1),
valid after a restart, and refused once their rollout was closed after they were issued. The runner gets one
per attempt from the admin API and gives it to the agent as its API key; a token opens only its harness's
route (`sessions.ROUTES`, checked by `edge.grant`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from rollbus.services.adapter.sessions import CLAUDE_CODE

TOKEN_PREFIX = "rb1"


@dataclass(frozen=True)
class Grant:
    """What a valid session token says: the rollout, its attempt, and when it was issued."""

    rollout_id: str
    attempt_id: str = ""
    issued_at: float = 0.0
    harness: str | None = CLAUDE_CODE  # None: any route (``open_sessions``, dev only)


class SessionTokens:
    """Issues and checks session tokens; ``open_sessions`` (dev) takes any token as the rollout id.

    A token is ``rb1.<payload>.<hmac>``: nothing to look up, so checking it costs the same at 20k
    sessions as at one, and a restarted adapter (or a replica) with the same key accepts it. Closing a
    rollout refuses every token issued before the close; that record is kept for ``ttl`` seconds, the
    life of a token.
    """

    def __init__(
        self,
        key: bytes,
        *,
        open_sessions: bool = False,
        ttl: float = 7 * 24 * 3600.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.key = key
        self.open_sessions = open_sessions
        self.ttl = ttl
        self.clock = clock
        self._issued: dict[str, float] = {}  # rollout id -> when its latest token was issued (unused check)
        self._closed: dict[str, float] = {}  # rollout id -> when it was closed

    def issue(self, rollout_id: str, attempt_id: str = "", harness: str = CLAUDE_CODE) -> str:
        # a rollout opened again after a close gets tokens issued after it (strictly, whatever the clock)
        now = max(self.clock(), self._closed.get(rollout_id, float("-inf")) + 1e-3)
        data = [rollout_id, attempt_id, now, harness]
        payload = base64.urlsafe_b64encode(json.dumps(data).encode()).decode()
        self._issued[rollout_id] = now
        return f"{TOKEN_PREFIX}.{payload}.{self._mac(payload)}"

    def _mac(self, payload: str) -> str:
        return hmac.new(self.key, payload.encode(), hashlib.sha256).hexdigest()[:40]

    def verify(self, token: str) -> Grant | None:
        """The grant of a valid, unexpired token whose rollout was not closed after it was issued."""
        grant = self._decode(token)
        if grant is None:
            open_ = self.open_sessions and token and token not in self._closed
            return Grant(token, harness=None) if open_ else None
        closed_at = self._closed.get(grant.rollout_id)
        if closed_at is not None and grant.issued_at <= closed_at:
            return None
        if self.clock() - grant.issued_at > self.ttl:
            return None
        return grant

    def _decode(self, token: str) -> Grant | None:
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != TOKEN_PREFIX or len(token) > 4096:
            return None
        if not hmac.compare_digest(self._mac(parts[1]).encode(), parts[2].encode()):
            return None
        try:
            rollout, attempt, issued, *harness = json.loads(base64.urlsafe_b64decode(parts[1].encode()))
        except (ValueError, TypeError):
            return None
        # a token minted before harnesses were bound (3 fields) is a Claude Code rollout's
        return Grant(str(rollout), str(attempt), float(issued), str(harness[0]) if harness else CLAUDE_CODE)

    def rollout_for(self, token: str) -> str | None:
        grant = self.verify(token)
        return grant.rollout_id if grant is not None else None

    def unused(self, issued_before: float, in_use: Container[str]) -> list[str]:
        """Rollouts whose tokens were issued before ``issued_before`` and never started a session."""
        return [r for r, at in self._issued.items() if at < issued_before and r not in in_use]

    def revoke(self, rollout_id: str, at: float | None = None) -> None:
        """Refuse the rollout's tokens issued until now (or ``at``); O(1), old records pruned."""
        now = self.clock()
        self._closed[rollout_id] = now if at is None else at
        self._issued.pop(rollout_id, None)
        while self._closed:
            oldest, closed_at = next(iter(self._closed.items()))
            if now - closed_at <= self.ttl:
                break
            del self._closed[oldest]

    def is_closed(self, rollout_id: str) -> bool:
        return rollout_id in self._closed
