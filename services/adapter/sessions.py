"""A live rollout's conversations: each :class:`Agent` (main, sub-agents, side calls) with its own history,
kept in the rollout's :class:`Session` until it closes (:class:`Sessions`).

A rollout's requests interleave several conversations on one wire: the main agent, sub-agents (the CLI
marks them with ``x-claude-code-agent-id``) and side calls (titles, tool-less helpers). Each is an
:class:`Agent` with its own history, so sub-agent and side turns never mix into the main trajectory.
The history names the agent's *chains* (``main``, ``main.1`` after a history rewrite, ...). Which agent a
request is, per harness, is :mod:`rollbus.services.adapter.attribution`; which rollout (the session token)
is :mod:`rollbus.services.adapter.tokens`.

Threat model: the session token sits in the agent's environment, so the agent's own tools (a ``curl``
from Bash) can send requests with it. A chain trains only when its origin is proven:

* the sandbox's adapter proxy stamps every request with :data:`PEER_HEADER`; a tool's request
  (``tool``) is ``unattributed`` (recorded, never trained) whatever it claims to be;
* a new conversation is a trainable ``subagent`` only if it answers an ``Agent`` tool call of the main
  chain's newest turn and its first user message carries that call's prompt; a second conversation
  claiming the same call makes it ambiguous: the claimant's chain ends ``ambiguous`` and neither trains;
* Codex names each conversation by its thread id (``attribution.codex_thread``): a thread other than the
  root is a trainable ``subagent`` only if its prompt is the ``message`` of an unclaimed ``spawn_agent``
  call in main's live chain (Codex spawns without waiting, so not only the newest turn); claims are
  contested the same way;
* main's history is rewritten (compaction) only by a request with main's system prompt; after a
  restart that prompt is unknown, so such a request is ambiguous too;
* a token opens only its harness's route (:data:`HARNESSES`).

A rollout may open at most ``max_chains`` chains.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollbus.events import ChainKind
from rollbus.services.adapter.canonical import History

MAIN: ChainKind = "main"
SUBAGENT: ChainKind = "subagent"
SIDE: ChainKind = "side"
UNATTRIBUTED: ChainKind = "unattributed"
#: which harness a rollout runs, and so the one API its token opens: the Claude Code CLI speaks
#: Anthropic's ``/v1/messages``, Codex the Responses API, a gym episode and mini-swe-agent OpenAI's
#: ``/v1/chat/completions``. A new harness that speaks one of them is one entry in ``ROUTES``.
CLAUDE_CODE, CODEX, GYM, MINI_SWE_AGENT = "claude_code", "codex", "gym", "mini_swe_agent"
ROUTES = {
    CLAUDE_CODE: "/v1/messages",
    CODEX: "/v1/responses",
    GYM: "/v1/chat/completions",
    MINI_SWE_AGENT: "/v1/chat/completions",
}
HARNESSES = tuple(ROUTES)
#: set by the sandbox's adapter proxy (rollbus/sandbox/adapter_proxy.py) on every request it forwards,
#: a client's own copy removed: ``agent`` when the harness's own process (the CLI) opened the connection,
#: ``tool`` for any other process in the sandbox. Absent: a host-side caller (the gym runner, tests).
PEER_HEADER = "x-rollbus-peer"
AGENT_PEER, TOOL_PEER = "agent", "tool"
#: why a conversation is unattributed (recorded, never trained), as counted in the adapter's metrics
FROM_A_TOOL = "tool_peer"  # the proxy says a tool, not the agent, sent it
NO_AGENT_CALL = "no_agent_call"  # a new conversation that answers no open Agent call
CONTESTED_CALL = "contested_call"  # a second conversation claims an Agent call: every claimant is
RESTORED_MAIN = "restored_main"  # after a restart: main's system prompt unknown, its rewrite unprovable


NewHistory = Callable[[str], History]  # agent name -> a fresh history whose chains carry that name
#: a harness's rule for which open sub-agent call a new conversation answers: (call id or None, contested ids)
FindCall = Callable[["Session", "RequestShape"], tuple[str | None, list[str]]]


@dataclass
class Agent:
    """One conversation of a rollout. Its lock keeps plan -> generate -> commit of its turns in order."""

    rollout_id: str
    name: str
    kind: ChainKind
    history: History
    system: str | None = ""  # None: unknown (rebuilt from the bus, which does not keep it)
    parent: Agent | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    session: Session | None = None
    agent_id: str | None = None  # the CLI's x-claude-code-agent-id
    parent_tool_use_id: str | None = None  # the parent's Agent call this sub-agent answers
    cause: str | None = None  # why it is unattributed (FROM_A_TOOL, ...), for the metrics
    contested: bool = False  # another conversation claimed its Agent call: its chain ends `ambiguous`
    answered: Any = None  # the Responses route's last streamed turn, for a retry of it (stream_retry.py)

    @property
    def chain_id(self) -> str:
        return self.history.chain_id

    @property
    def attempt_id(self) -> str:
        return self.session.attempt_id if self.session is not None else ""

    @property
    def closed(self) -> bool:
        """Its rollout was closed: a turn still generating must not be recorded."""
        return self.session is not None and self.session.closed


@dataclass(frozen=True)
class RequestShape:
    """What routing looks at: the CLI's agent header, the system prompt and the translated request."""

    agent_id: str | None
    system: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    peer: str | None = None  # PEER_HEADER: AGENT_PEER, TOOL_PEER, or None for a host-side caller

    def fingerprint(self) -> str:
        first = next((m.get("content") for m in self.messages if m.get("role") == "user"), "")
        return hashlib.sha256(f"{self.system}\x00{first}".encode()).hexdigest()[:12]


@dataclass
class Session:
    """The agents of one rollout; ``last_active`` is when it last got a request or had a turn running."""

    rollout_id: str
    new_history: NewHistory
    last_active: float = 0.0
    attempt_id: str = ""
    closed: bool = False
    chains_opened: int = 0  # chains this rollout started (every agent, every rewrite)
    agents: dict[str, Agent] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)  # Agent tool calls already answered by a sub-agent
    note: Callable[[str], None] = field(default=lambda cause: None, repr=False)  # an ambiguity, counted
    _side_serial: itertools.count = field(default_factory=itertools.count)

    def from_a_tool(self, shape: RequestShape) -> Agent:
        """A tool's conversation: its own earlier chain if it continues one, else a new one; never trained."""
        for agent in self.agents.values():
            if agent.cause == FROM_A_TOOL and agent.history.turns and continues(agent, shape):
                return agent
        return self.unattributed(f"{FROM_A_TOOL}-{shape.fingerprint()}", shape, FROM_A_TOOL)

    def unattributed(self, name: str, shape: RequestShape, cause: str) -> Agent:
        """The named conversation, kept but never trained (``cause`` says why)."""
        known = self.agents.get(name)
        if known is not None:
            return known
        agent = self.new(name, UNATTRIBUTED, shape, keep=True)
        agent.cause = cause
        return agent

    def get_or_new(self, name: str, shape: RequestShape, find: FindCall) -> Agent:
        """The named sub-agent, or a new one: ``subagent`` if it answers an unclaimed sub-agent call of
        main's (``find``, the harness's rule in :mod:`rollbus.services.adapter.attribution`), else
        unattributed. A second claim of one call makes every claimant ambiguous: none of them trains."""
        known = self.agents.get(name)
        if known is not None:
            return known
        call, contested = find(self, shape)
        if contested:
            for agent in self.agents.values():
                if agent.kind == SUBAGENT and agent.parent_tool_use_id in contested:
                    agent.contested = True
            self.note(CONTESTED_CALL)
            return self.unattributed(name, shape, CONTESTED_CALL)
        if call is None:
            return self.unattributed(name, shape, NO_AGENT_CALL)
        agent = self.new(name, SUBAGENT, shape, keep=True)
        self.claimed.add(call)
        agent.parent_tool_use_id = call
        return agent

    def contenders(self) -> list[Agent]:
        """Sub-agents whose Agent call was claimed again and whose chain has not ended yet."""
        return [a for a in self.agents.values() if a.contested]

    def side_name(self) -> str:
        """A fresh name for a side call (side calls are not kept)."""
        return f"side-{next(self._side_serial)}"

    def new(self, name: str, kind: ChainKind, shape: RequestShape, *, keep: bool) -> Agent:
        """A new conversation of this rollout (``keep``: routed to again by name)."""
        parent = self.agents.get(MAIN) if kind != MAIN else None
        agent = Agent(self.rollout_id, name, kind, self.new_history(name), shape.system, parent, session=self)
        agent.agent_id = shape.agent_id
        if keep:
            self.agents[name] = agent
        return agent

    def busy(self) -> bool:
        """Whether one of its agents has a turn in flight (side calls are not kept, so not seen)."""
        return any(agent.lock.locked() for agent in self.agents.values())

    def finished_subagents(self) -> list[Agent]:  # unattributed chains are never handed back
        """Sub-agents with a live chain and no turn in flight: the main agent just got their results."""
        return [
            a for a in self.agents.values() if a.kind == SUBAGENT and a.history.turns and not a.lock.locked()
        ]


def continues(agent: Agent, shape: RequestShape) -> bool:
    """Whether the request extends the agent's live chain."""
    return agent.history.continues(shape.messages, shape.tools)


class Sessions:
    """Every live rollout's :class:`Session`, created on its first request; it lives until the admin API
    closes it or it goes idle (:mod:`rollbus.services.adapter.expiry`)."""

    def __init__(
        self,
        new_history: NewHistory,
        clock: Callable[[], float] = time.monotonic,
        note: Callable[[str], None] = lambda cause: None,
    ) -> None:
        self.new_history = new_history
        self.clock = clock
        self.note = note  # an ambiguous attribution, by cause (the adapter counts them)
        self._sessions: dict[str, Session] = {}

    def get(self, rollout_id: str, attempt_id: str = "") -> Session:
        """The rollout's session, created if new; a request is activity, so it counts as active now."""
        session = self._sessions.get(rollout_id)
        if session is None:
            session = self._sessions[rollout_id] = Session(
                rollout_id, self.new_history, attempt_id=attempt_id, note=self.note
            )
        session.last_active = self.clock()
        return session

    def peek(self, rollout_id: str) -> Session | None:
        """The rollout's live session, if any (not counted as activity)."""
        return self._sessions.get(rollout_id)

    def pop(self, rollout_id: str) -> Session | None:
        """Remove the session and mark it closed: its turns still generating will not be recorded."""
        session = self._sessions.pop(rollout_id, None)
        if session is not None:
            session.closed = True
        return session

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
            self.pop(session.rollout_id)
        return idle
