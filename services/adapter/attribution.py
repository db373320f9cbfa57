"""Which agent of a rollout sent a request: one strategy per harness, over a rollout's
:class:`~rollbus.services.adapter.sessions.Session`.

* :func:`claude_code`: the Claude Code CLI interleaves main, sub-agents (``x-claude-code-agent-id``, or
  told apart by their history and system prompt) and tool-less side calls on one wire;
* :func:`codex_thread`: Codex names each conversation by its thread id;
* :func:`one_per_token`: every request of a session token is the rollout's main agent (OpenAI chat).

Threat model (the session token sits in the agent's environment, so its tools can call the adapter too): a
tool's request (``x-rollbus-peer: tool``) is unattributed whatever it claims; a new conversation is a
trainable ``subagent`` only if it answers an unclaimed sub-agent call of main's (Claude Code's ``Agent`` call
of main's newest turn, opening with its prompt; Codex's ``spawn_agent`` call anywhere in main's live chain,
whose ``message`` is the thread's prompt); a second claim of one call makes every claimant ambiguous; main's
history is rewritten (compaction) only by a request with main's system prompt, unknown after a restart.
"""

from __future__ import annotations

import json
from typing import Any

from rollbus.services.adapter.sessions import (
    MAIN,
    RESTORED_MAIN,
    SIDE,
    SUBAGENT,
    TOOL_PEER,
    UNATTRIBUTED,
    Agent,
    RequestShape,
    Session,
    continues,
)

AGENT_TOOLS = ("Agent", "Task")  # the CLI's sub-agent tool (named Task before 2.1)
SPAWN_TOOL = "spawn_agent"  # Codex's (namespace ``multi_agent_v1``): the child's prompt is its ``message``
NOTIFICATION_OPEN, NOTIFICATION_CLOSE = "<subagent_notification>", "</subagent_notification>"


def claude_code(session: Session, shape: RequestShape) -> Agent:
    """Unattributed if a tool sent it; side if tool-less; a sub-agent by header, or by a history or
    system prompt that is not main's. Main's history is rewritten only by a request whose origin is
    proven: not a tool's, with main's system prompt known (not rebuilt from the bus)."""
    if shape.peer == TOOL_PEER:
        return session.from_a_tool(shape)
    if not shape.tools:
        return session.new(session.side_name(), SIDE, shape, keep=False)
    if shape.agent_id is not None:
        return session.get_or_new(f"agent-{shape.agent_id}", shape, agent_call_for)
    main = session.agents.get(MAIN)
    if main is None or not main.history.turns or continues(main, shape):
        main = session.agents.get(MAIN) or session.new(MAIN, MAIN, shape, keep=True)
        if main.system is None:  # rebuilt from the bus: the request echoing its last turn tells it
            main.system = shape.system
        return main
    for agent in session.agents.values():
        if agent.kind in (SUBAGENT, UNATTRIBUTED) and agent.history.turns and continues(agent, shape):
            return agent
    if main.system is None:  # rebuilt from the bus: nothing proves this rewrite is main's
        session.note(RESTORED_MAIN)
        return session.unattributed(f"{RESTORED_MAIN}-{shape.fingerprint()}", shape, RESTORED_MAIN)
    if shape.system == main.system:
        return main  # the main agent with a rewritten history (compaction): its history starts a chain
    return session.get_or_new(f"agent-{shape.fingerprint()}", shape, agent_call_for)


def one_per_token(session: Session, shape: RequestShape) -> Agent:
    """The rollout's main agent whatever the request looks like: one conversation per session token
    (the OpenAI chat protocol, :mod:`rollbus.services.adapter.openai`); a tool's request is unattributed."""
    if shape.peer == TOOL_PEER:
        return session.from_a_tool(shape)
    main = session.agents.get(MAIN)
    if main is None:
        main = session.new(MAIN, MAIN, RequestShape(None, shape.system, [], []), keep=True)
    return main


def codex_thread(session: Session, shape: RequestShape, thread: str | None, root: str | None) -> Agent:
    """Codex: one conversation per thread. The root thread (``thread`` is the session's ``root``, or
    not given) is main; any other thread is ``agent-<thread>``, a sub-agent if it answers an unclaimed
    ``spawn_agent`` call (:func:`spawn_call_for`), else unattributed; a tool's request is
    unattributed whatever thread it names."""
    if shape.peer == TOOL_PEER:
        return session.from_a_tool(shape)
    if thread is None or thread == root:
        return one_per_token(session, shape)
    child = RequestShape(thread, shape.system, shape.messages, shape.tools, shape.peer)
    return session.get_or_new(f"agent-{thread}", child, spawn_call_for)


def agent_call_for(session: Session, shape: RequestShape) -> tuple[str | None, list[str]]:
    """The unclaimed Agent call of main's newest turn whose prompt opens this conversation; if every
    such call is claimed already, those calls (contested)."""
    main = session.agents.get(MAIN)
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
        if call_id not in session.claimed:
            return call_id, []
        contested.append(call_id)
    return None, contested


def spawn_call_for(session: Session, shape: RequestShape) -> tuple[str | None, list[str]]:
    """The unclaimed ``spawn_agent`` call of main's live chain whose ``message`` is this thread's prompt
    (its last user message, exactly); if every such call is claimed already, those calls (contested).

    Not only the newest turn, and main may be generating: Codex's parent goes on while its child
    starts, so the parent's next turn can be planned, or even done, before the child's first request."""
    main = session.agents.get(MAIN)
    users = [m.get("content") for m in shape.messages if m.get("role") == "user"]
    prompt = users[-1].strip() if users and isinstance(users[-1], str) else ""
    if main is None or not prompt:
        return None, []
    contested = []
    for sent in main.history.sent:
        for call_id, name, arguments in sent.tool_calls if sent is not None else ():
            if name != SPAWN_TOOL or _argument(arguments, "message") != prompt:
                continue
            if call_id not in session.claimed:
                return call_id, []
            contested.append(call_id)
    return None, contested


def notified_subagents(session: Session, messages: list[dict[str, Any]]) -> list[Agent]:
    """Codex sub-agents with a live chain whose completion main's request reports: a
    ``<subagent_notification>`` naming their thread after main's last assistant message (Codex sends
    one when a child's turn ends). Older ones are history: a child resumed since is not ended by them."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    threads = {thread for m in messages[last + 1 :] if (thread := notified_thread(m)) is not None}
    return [
        a
        for a in session.agents.values()
        if a.kind == SUBAGENT and a.agent_id in threads and a.history.turns and not a.lock.locked()
    ]


def _argument(arguments: str, key: str) -> str:
    """A tool call's string argument ``key``, stripped ("" when the arguments are not JSON or lack it): the
    sub-agent's prompt of Claude Code's ``Agent`` call, the ``message`` of Codex's ``spawn_agent``."""
    try:
        value = json.loads(arguments).get(key)
    except (ValueError, AttributeError):
        return ""
    return value.strip() if isinstance(value, str) else ""


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
