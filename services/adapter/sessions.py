"""Which rollout a request belongs to (its session token) and which agent of that rollout sent it.

A rollout's requests interleave several conversations on one wire: the main agent, sub-agents (the CLI
marks them with ``x-claude-code-agent-id``) and side calls (titles, tool-less helpers). Each is an
:class:`Agent` with its own history, so sub-agent and side turns never mix into the main trajectory.
The history names the agent's *chains* (``main``, ``main.1`` after a history rewrite, ...).

Threat model: the session token sits in the agent's environment, so the agent's own tools (a ``curl``
from Bash) can send requests with it. A chain trains only when its origin is proven:

* the sandbox's adapter proxy stamps every request with :data:`PEER_HEADER`; a tool's request
  (``tool``) is ``unattributed`` (recorded, never trained) whatever it claims to be;
* a new conversation is a trainable ``subagent`` only if it answers an ``Agent`` tool call of the main
  chain's newest turn and its first user message carries that call's prompt; a second conversation
  claiming the same call makes it ambiguous: the claimant's chain ends ``ambiguous`` and neither trains;
* Codex names each conversation by its thread id (:meth:`Session.thread_agent`): a thread other than the
  root is a trainable ``subagent`` only if its prompt is the ``message`` of an unclaimed ``spawn_agent``
  call in main's live chain (Codex spawns without waiting, so not only the newest turn); claims are
  contested the same way;
* main's history is rewritten (compaction) only by a request with main's system prompt; after a
  restart that prompt is unknown, so such a request is ambiguous too;
* a token opens only its harness's route (:data:`HARNESSES`).

A rollout may open at most ``max_chains`` chains. Tokens are HMACs of (rollout, attempt, issue time,
harness) under the adapter's signing key: checked in O(1), valid after a restart, and refused once
their rollout was closed after they were issued.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import itertools
import json
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Any

from rollbus.services.adapter.canonical import History

MAIN, SUBAGENT, SIDE, UNATTRIBUTED = "main", "subagent", "side", "unattributed"
TOKEN_PREFIX = "rb1"
AGENT_TOOLS = ("Agent", "Task")  # the CLI's sub-agent tool (named Task before 2.1)
SPAWN_TOOL = "spawn_agent"  # Codex's (namespace ``multi_agent_v1``): the child's prompt is its ``message``
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


@dataclass
class Agent:
    """One conversation of a rollout. Its lock keeps plan -> generate -> commit of its turns in order."""

    rollout_id: str
    name: str
    kind: str
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

    def route(self, shape: RequestShape) -> Agent:
        """Unattributed if a tool sent it; side if tool-less; a sub-agent by header, or by a history or
        system prompt that is not main's. Main's history is rewritten only by a request whose origin is
        proven: not a tool's, with main's system prompt known (not rebuilt from the bus)."""
        if shape.peer == TOOL_PEER:
            return self._from_a_tool(shape)
        if not shape.tools:
            return self._new(f"side-{next(self._side_serial)}", SIDE, shape, keep=False)
        if shape.agent_id is not None:
            return self._get_or_new(f"agent-{shape.agent_id}", shape)
        main = self.agents.get(MAIN)
        if main is None or not main.history.turns or _continues(main, shape):
            main = self.agents.get(MAIN) or self._new(MAIN, MAIN, shape, keep=True)
            if main.system is None:  # rebuilt from the bus: the request echoing its last turn tells it
                main.system = shape.system
            return main
        for agent in self.agents.values():
            if agent.kind in (SUBAGENT, UNATTRIBUTED) and agent.history.turns and _continues(agent, shape):
                return agent
        if main.system is None:  # rebuilt from the bus: nothing proves this rewrite is main's
            self.note(RESTORED_MAIN)
            return self._unattributed(f"{RESTORED_MAIN}-{shape.fingerprint()}", shape, RESTORED_MAIN)
        if shape.system == main.system:
            return main  # the main agent with a rewritten history (compaction): its history starts a chain
        return self._get_or_new(f"agent-{shape.fingerprint()}", shape)

    def main_agent(self, shape: RequestShape) -> Agent:
        """The rollout's main agent whatever the request looks like: one conversation per session token
        (the OpenAI route, :mod:`rollbus.services.adapter.openai`); a tool's request is unattributed."""
        if shape.peer == TOOL_PEER:
            return self._from_a_tool(shape)
        main = self.agents.get(MAIN)
        if main is None:
            main = self._new(MAIN, MAIN, RequestShape(None, shape.system, [], []), keep=True)
        return main

    def _from_a_tool(self, shape: RequestShape) -> Agent:
        """A tool's conversation: its own earlier chain if it continues one, else a new one; never trained."""
        for agent in self.agents.values():
            if agent.cause == FROM_A_TOOL and agent.history.turns and _continues(agent, shape):
                return agent
        return self._unattributed(f"{FROM_A_TOOL}-{shape.fingerprint()}", shape, FROM_A_TOOL)

    def _unattributed(self, name: str, shape: RequestShape, cause: str) -> Agent:
        known = self.agents.get(name)
        if known is not None:
            return known
        agent = self._new(name, UNATTRIBUTED, shape, keep=True)
        agent.cause = cause
        return agent

    def thread_agent(self, shape: RequestShape, thread: str | None, root: str | None) -> Agent:
        """Codex: one conversation per thread. The root thread (``thread`` is the session's ``root``, or
        not given) is main; any other thread is ``agent-<thread>``, a sub-agent if it answers an unclaimed
        ``spawn_agent`` call (:meth:`_spawn_call_for`), else unattributed; a tool's request is
        unattributed whatever thread it names."""
        if shape.peer == TOOL_PEER:
            return self._from_a_tool(shape)
        if thread is None or thread == root:
            return self.main_agent(shape)
        child = RequestShape(thread, shape.system, shape.messages, shape.tools, shape.peer)
        return self._get_or_new(f"agent-{thread}", child, self._spawn_call_for)

    def _get_or_new(
        self,
        name: str,
        shape: RequestShape,
        find: Callable[[RequestShape], tuple[str | None, list[str]]] | None = None,
    ) -> Agent:
        """The named sub-agent, or a new one: ``subagent`` if it answers an unclaimed Agent call (``find``:
        :meth:`_agent_call_for` unless given), else unattributed. A second claim of one call makes every
        claimant ambiguous: none of them trains."""
        known = self.agents.get(name)
        if known is not None:
            return known
        call, contested = (find or self._agent_call_for)(shape)
        if contested:
            for agent in self.agents.values():
                if agent.kind == SUBAGENT and agent.parent_tool_use_id in contested:
                    agent.contested = True
            self.note(CONTESTED_CALL)
            return self._unattributed(name, shape, CONTESTED_CALL)
        if call is None:
            return self._unattributed(name, shape, NO_AGENT_CALL)
        agent = self._new(name, SUBAGENT, shape, keep=True)
        self.claimed.add(call)
        agent.parent_tool_use_id = call
        return agent

    def _agent_call_for(self, shape: RequestShape) -> tuple[str | None, list[str]]:
        """The unclaimed Agent call of main's newest turn whose prompt opens this conversation; if every
        such call is claimed already, those calls (contested)."""
        main = self.agents.get(MAIN)
        newest = main.history.sent[-1] if main is not None and main.history.sent else None
        if main is None or newest is None or main.lock.locked():
            return None, []  # no main turn known, or main is generating: it cannot wait on a sub-agent
        first = next((m.get("content") for m in shape.messages if m.get("role") == "user"), None)
        if not isinstance(first, str):
            return None, []
        contested = []
        for call_id, name, arguments in newest.tool_calls:
            prompt = _argument(arguments, "prompt") if name in AGENT_TOOLS else ""
            if not prompt or prompt not in first:
                continue
            if call_id not in self.claimed:
                return call_id, []
            contested.append(call_id)
        return None, contested

    def _spawn_call_for(self, shape: RequestShape) -> tuple[str | None, list[str]]:
        """The unclaimed ``spawn_agent`` call of main's live chain whose ``message`` is this thread's prompt
        (its last user message, exactly); if every such call is claimed already, those calls (contested).

        Not only the newest turn, and main may be generating: Codex's parent goes on while its child
        starts, so the parent's next turn can be planned, or even done, before the child's first request."""
        main = self.agents.get(MAIN)
        users = [m.get("content") for m in shape.messages if m.get("role") == "user"]
        prompt = users[-1].strip() if users and isinstance(users[-1], str) else ""
        if main is None or not prompt:
            return None, []
        contested = []
        for sent in main.history.sent:
            for call_id, name, arguments in sent.tool_calls if sent is not None else ():
                if name != SPAWN_TOOL or _argument(arguments, "message") != prompt:
                    continue
                if call_id not in self.claimed:
                    return call_id, []
                contested.append(call_id)
        return None, contested

    def notified_subagents(self, messages: list[dict[str, Any]]) -> list[Agent]:
        """Codex sub-agents with a live chain whose completion main's request reports: a
        ``<subagent_notification>`` naming their thread after main's last assistant message (Codex sends
        one when a child's turn ends). Older ones are history: a child resumed since is not ended by them."""
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
        threads = {thread for m in messages[last + 1 :] if (thread := notified_thread(m)) is not None}
        return [
            a
            for a in self.agents.values()
            if a.kind == SUBAGENT and a.agent_id in threads and a.history.turns and not a.lock.locked()
        ]

    def contenders(self) -> list[Agent]:
        """Sub-agents whose Agent call was claimed again and whose chain has not ended yet."""
        return [a for a in self.agents.values() if a.contested]

    def _new(self, name: str, kind: str, shape: RequestShape, *, keep: bool) -> Agent:
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


def _continues(agent: Agent, shape: RequestShape) -> bool:
    return agent.history.continues(shape.messages, shape.tools)


def _argument(arguments: str, key: str) -> str:
    """A tool call's string argument ``key``, stripped ("" when the arguments are not JSON or lack it): the
    sub-agent's prompt of Claude Code's ``Agent`` call, the ``message`` of Codex's ``spawn_agent``."""
    try:
        value = json.loads(arguments).get(key)
    except (ValueError, AttributeError):
        return ""
    return value.strip() if isinstance(value, str) else ""


NOTIFICATION_OPEN, NOTIFICATION_CLOSE = "<subagent_notification>", "</subagent_notification>"


def notified_thread(message: dict[str, Any]) -> str | None:
    """The thread a Codex ``<subagent_notification>`` user message reports on (its ``agent_path``)."""
    text = message.get("content")
    if message.get("role") != "user" or not isinstance(text, str):
        return None
    text = text.strip()
    if not (text.startswith(NOTIFICATION_OPEN) and text.endswith(NOTIFICATION_CLOSE)):
        return None
    try:
        path = json.loads(text[len(NOTIFICATION_OPEN) : -len(NOTIFICATION_CLOSE)]).get("agent_path")
    except (ValueError, AttributeError, RecursionError):
        return None
    return path if isinstance(path, str) and path else None


def answers_agent_call(messages: list[dict[str, Any]]) -> bool:
    """Whether the request's newest tool results answer a sub-agent call of the last assistant turn."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        return False
    calls = {c["id"] for c in messages[last].get("tool_calls") or () if c["function"]["name"] in AGENT_TOOLS}
    return any(m.get("role") == "tool" and m.get("tool_call_id") in calls for m in messages[last + 1 :])


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
