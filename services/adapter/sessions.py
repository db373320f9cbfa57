"""Which rollout a request belongs to (its session token) and which agent of that rollout sent it.

A rollout's requests interleave several conversations on one wire: the main agent, sub-agents (the CLI
marks them with ``x-claude-code-agent-id``) and side calls (titles, tool-less helpers). Each is an
:class:`Agent` with its own history, so sub-agent and side turns never mix into the main trajectory.
The history names the agent's *chains* (``main``, ``main.1`` after a history rewrite, ...).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import secrets
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any, Protocol

MAIN, SUBAGENT, SIDE = "main", "subagent", "side"
AGENT_TOOLS = ("Agent", "Task")  # the CLI's sub-agent tool (named Task before 2.1)


class History(Protocol):
    """``rollbus.canonical.CanonicalHistory`` / ``RerenderHistory`` as the adapter uses them: both
    implement all of it, so nobody probes with ``getattr``."""

    turns: list[Any]

    @property
    def chain_id(self) -> str: ...

    def continues(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
        """Whether the request extends the live chain (routes requests without an agent header)."""

    def freeze(self, kind: Any) -> Any:
        """End the live chain (a finished sub-agent); the next plan starts a new chain."""

    def plan(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Any: ...

    def commit(
        self,
        plan: Any,
        output_ids: list[int],
        output_logprobs: list[float],
        finish_reason: str,
        policy_version: int,
        assistant_message: dict[str, Any],
    ) -> Any: ...


NewHistory = Callable[[str], History]  # agent name -> a fresh history whose chains carry that name


class SessionTokens:
    """Session token -> rollout id. Tokens come from the admin endpoint; ``open_sessions`` takes any."""

    def __init__(self, *, open_sessions: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        self.open_sessions = open_sessions
        self.clock = clock
        self._rollouts: dict[str, str] = {}
        self._issued: dict[str, float] = {}  # rollout id -> when its latest token was issued

    def issue(self, rollout_id: str) -> str:
        token = f"rb-{secrets.token_urlsafe(24)}"
        self._rollouts[token] = rollout_id
        self._issued[rollout_id] = self.clock()
        return token

    def unused(self, issued_before: float, in_use: Container[str]) -> list[str]:
        """Rollouts whose tokens were issued before ``issued_before`` and never started a session."""
        return [r for r, at in self._issued.items() if at < issued_before and r not in in_use]

    def rollout_for(self, token: str) -> str | None:
        for known, rollout_id in self._rollouts.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return rollout_id
        return token if self.open_sessions and token else None

    def revoke(self, rollout_id: str) -> None:
        self._rollouts = {t: r for t, r in self._rollouts.items() if r != rollout_id}
        self._issued.pop(rollout_id, None)


@dataclass
class Agent:
    """One conversation of a rollout. Its lock keeps plan -> generate -> commit of its turns in order."""

    rollout_id: str
    name: str
    kind: str
    history: History
    system: str = ""
    parent: Agent | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def chain_id(self) -> str:
        return self.history.chain_id


@dataclass(frozen=True)
class RequestShape:
    """What routing looks at: the CLI's agent header, the system prompt and the translated request."""

    agent_id: str | None
    system: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]

    def fingerprint(self) -> str:
        first = next((m.get("content") for m in self.messages if m.get("role") == "user"), "")
        return hashlib.sha256(f"{self.system}\x00{first}".encode()).hexdigest()[:12]


@dataclass
class Session:
    """The agents of one rollout; ``last_active`` is when it last got a request or had a turn running."""

    rollout_id: str
    new_history: NewHistory
    last_active: float = 0.0
    agents: dict[str, Agent] = field(default_factory=dict)
    _side_serial: itertools.count = field(default_factory=itertools.count)

    def route(self, shape: RequestShape) -> Agent:
        """Side if tool-less; a sub-agent by header, or by a history or system prompt that is not main's."""
        if not shape.tools:
            return self._new(f"side-{next(self._side_serial)}", SIDE, shape.system, keep=False)
        if shape.agent_id is not None:
            return self._get_or_new(f"agent-{shape.agent_id}", SUBAGENT, shape.system)
        main = self.agents.get(MAIN)
        if main is None or not main.history.turns or _continues(main, shape):
            return self._get_or_new(MAIN, MAIN, shape.system)
        for agent in self.agents.values():
            if agent.kind == SUBAGENT and agent.history.turns and _continues(agent, shape):
                return agent
        if shape.system == main.system:
            return main  # the main agent with a rewritten history (compaction): its history starts a chain
        return self._get_or_new(f"agent-{shape.fingerprint()}", SUBAGENT, shape.system)

    def _get_or_new(self, name: str, kind: str, system: str) -> Agent:
        return self.agents.get(name) or self._new(name, kind, system, keep=True)

    def _new(self, name: str, kind: str, system: str, *, keep: bool) -> Agent:
        parent = self.agents.get(MAIN) if kind != MAIN else None
        agent = Agent(self.rollout_id, name, kind, self.new_history(name), system, parent)
        if keep:
            self.agents[name] = agent
        return agent

    def busy(self) -> bool:
        """Whether one of its agents has a turn in flight (side calls are not kept, so not seen)."""
        return any(agent.lock.locked() for agent in self.agents.values())

    def finished_subagents(self) -> list[Agent]:
        """Sub-agents with a live chain and no turn in flight: the main agent just got their results."""
        return [
            a for a in self.agents.values() if a.kind == SUBAGENT and a.history.turns and not a.lock.locked()
        ]


def _continues(agent: Agent, shape: RequestShape) -> bool:
    return agent.history.continues(shape.messages, shape.tools)


def answers_agent_call(messages: list[dict[str, Any]]) -> bool:
    """Whether the request's newest tool results answer a sub-agent call of the last assistant turn."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        return False
    calls = {c["id"] for c in messages[last].get("tool_calls") or () if c["function"]["name"] in AGENT_TOOLS}
    return any(m.get("role") == "tool" and m.get("tool_call_id") in calls for m in messages[last + 1 :])


class Sessions:
    """Every live rollout's :class:`Session`, created on its first request; it lives until the admin API
    closes it or it goes idle (:mod:`services.adapter.expiry`)."""

    def __init__(self, new_history: NewHistory, clock: Callable[[], float] = time.monotonic) -> None:
        self.new_history = new_history
        self.clock = clock
        self._sessions: dict[str, Session] = {}

    def get(self, rollout_id: str) -> Session:
        """The rollout's session, created if new; a request is activity, so it counts as active now."""
        session = self._sessions.get(rollout_id)
        if session is None:
            session = self._sessions[rollout_id] = Session(rollout_id, self.new_history)
        session.last_active = self.clock()
        return session

    def pop(self, rollout_id: str) -> Session | None:
        return self._sessions.pop(rollout_id, None)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._sessions

    def expire(self, idle_since: float) -> list[Session]:
        """Remove and return the sessions not active since ``idle_since``; a turn in flight is activity."""
        now = self.clock()
        for session in self._sessions.values():
            if session.busy():
                session.last_active = now
        idle = [s for s in self._sessions.values() if s.last_active < idle_since]
        for session in idle:
            del self._sessions[session.rollout_id]
        return idle
