"""Codex's sub-agents on the adapter, the pure parts: its namespace tools offered and answered with their
namespace, each thread its own conversation, a child thread trained only when it answers a ``spawn_agent``
call of main's, and its chain ended by the notification Codex gives the parent."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollbus.services.adapter.assistant import AssistantTurn, ToolCall
from rollbus.services.adapter.attribution import codex_thread, notified_subagents, notified_thread
from rollbus.services.adapter.canonical import CanonicalHistory, TemplateRenderer, canonical_history
from rollbus.services.adapter.responses import (
    ResponsesRequest,
    namespaces,
    offered_tools,
    output_items,
    to_chat,
)
from rollbus.services.adapter.sessions import (
    CONTESTED_CALL,
    MAIN,
    NO_AGENT_CALL,
    SUBAGENT,
    TOOL_PEER,
    UNATTRIBUTED,
    RequestShape,
    Session,
    Sessions,
)
from rollbus.tokenizer import load_tokenizer

ROOT = "01a2-root"
PROMPT = "Read calc.py and report what sum_to returns."
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
SPAWN = {
    "type": "function",
    "name": "spawn_agent",
    "parameters": {"type": "object", "properties": {"message": {"type": "string"}}},
}
WAIT = {"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [SPAWN, WAIT]}


def test_a_namespaces_functions_are_offered_by_name_and_their_calls_carry_the_namespace() -> None:
    functions, custom = offered_tools([EXEC, NAMESPACE, {"type": "web_search"}])
    assert [f["function"]["name"] for f in functions] == ["exec_command", "spawn_agent", "wait_agent"]
    assert custom == frozenset()
    spaces = namespaces([EXEC, NAMESPACE])
    assert spaces == {"spawn_agent": "multi_agent_v1", "wait_agent": "multi_agent_v1"}
    calls = (
        ToolCall("c1", "spawn_agent", {"message": PROMPT}),
        ToolCall("c2", "exec_command", {"cmd": "ls"}),
    )
    message = AssistantTurn("ab", "m", tool_calls=calls)
    spawn, shell = output_items(message, custom, spaces)
    assert (spawn["type"], spawn["namespace"], spawn["name"]) == (
        "function_call",
        "multi_agent_v1",
        "spawn_agent",
    )
    assert "namespace" not in shell
    assert "namespace" not in output_items(message, custom)[0]  # no namespace offered: none claimed
    # Codex echoes the item with its namespace: it reads back as the call we committed
    echoed = ResponsesRequest(model="m", input=[{"type": "message", "role": "user", "content": "go"}, spawn])
    (call,) = to_chat(echoed).messages[-1]["tool_calls"]
    assert call == {
        "id": "c1",
        "type": "function",
        "function": {"name": "spawn_agent", "arguments": {"message": PROMPT}},
    }


def test_a_function_of_a_namespace_may_not_shadow_another_tool() -> None:
    with pytest.raises(Exception, match="unique"):
        offered_tools([SPAWN, NAMESPACE])


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("qwen3.6")


@pytest.fixture(scope="module")
def shared_renderer(tokenizer):
    """Every history of the module renders with one real template renderer: building one takes seconds (its
    markup tables), and a session builds a history per conversation."""
    renderer = TemplateRenderer(tokenizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(canonical_history, "TemplateRenderer", lambda *args, **kwargs: renderer)
        yield renderer


def chat_tools(tools: list[dict]) -> list[dict]:
    return offered_tools(tools)[0]


def opening(prompt: str) -> list[dict]:
    return [{"role": "system", "content": "You code."}, {"role": "user", "content": "<env/>"},
            {"role": "user", "content": prompt}]  # fmt: skip


def spawn_turn(session: Session, *calls: tuple[str, str]) -> None:
    """Main commits one turn (on top of what it has) calling ``spawn_agent`` with each (call id, message)."""
    main = codex_thread(session, RequestShape(None, "You code.", [], []), ROOT, ROOT)
    messages = opening("Use a sub-agent.")
    for i, sent in enumerate(main.history.sent):
        messages += [_assistant(sent.tool_calls), *_outputs(sent.tool_calls, i)]
    plan = main.history.plan(messages, chat_tools([EXEC, NAMESPACE]))
    tool_calls = tuple((cid, "spawn_agent", json.dumps({"message": text})) for cid, text in calls)
    main.history.commit(plan, [11, 12], [-0.5, -0.25], "stop", 0, _assistant(tool_calls))


def _assistant(calls) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": json.loads(args)}}
        for cid, name, args in calls
    ]}  # fmt: skip


def _outputs(calls, turn: int) -> list[dict]:
    return [
        {"role": "tool", "tool_call_id": cid, "content": f'{{"agent_id":"t{turn}"}}'} for cid, _, _ in calls
    ]


def child(session: Session, thread: str, prompt: str = PROMPT, peer: str | None = None):
    shape = RequestShape(None, "You code.", opening(prompt), chat_tools([EXEC]), peer)
    return codex_thread(session, shape, thread, ROOT)


@pytest.fixture
def session(tokenizer, shared_renderer) -> Session:
    return Sessions(lambda name: CanonicalHistory(tokenizer, chain_name=name)).get("r1")


def test_the_root_thread_is_main_and_a_child_answering_a_spawn_call_is_a_subagent(session) -> None:
    spawn_turn(session, ("call_a", PROMPT))
    main = session.agents[MAIN]
    assert codex_thread(session, RequestShape(None, "", [], []), None, None) is main  # no thread: main
    agent = child(session, "t-child")
    assert (agent.kind, agent.name, agent.agent_id) == (SUBAGENT, "agent-t-child", "t-child")
    assert (agent.parent, agent.parent_tool_use_id) == (main, "call_a")
    assert child(session, "t-child") is agent  # its later requests: the same conversation
    assert agent.chain_id == "agent-t-child" and main.chain_id == "main"


def test_a_spawn_call_before_main_newest_turn_is_claimed_while_main_is_generating(session) -> None:
    """Codex's parent goes on while its child starts: by the child's first request main may have a newer
    turn (its wait_agent call) and be generating the next one."""
    spawn_turn(session, ("call_a", PROMPT))
    spawn_turn(session, ("call_b", "Something else."))

    async def claim():
        async with session.agents[MAIN].lock:
            return child(session, "t-child")

    agent = asyncio.run(claim())
    assert (agent.kind, agent.parent_tool_use_id) == (SUBAGENT, "call_a")


def test_a_thread_answering_no_spawn_call_or_sent_by_a_tool_is_unattributed(session) -> None:
    assert child(session, "t-early").kind == UNATTRIBUTED  # before any main turn
    spawn_turn(session, ("call_a", PROMPT))
    stranger = child(session, "t-other", prompt="Read calc.py")  # a part of the message is not the message
    assert (stranger.kind, stranger.cause) == (UNATTRIBUTED, NO_AGENT_CALL)
    spawn_turn(session, ("call_items", ""))  # a spawn by `items` only: no message to match
    assert child(session, "t-blank", prompt=" ").kind == UNATTRIBUTED
    tool = child(session, "t-tool", peer=TOOL_PEER)
    assert tool.kind == UNATTRIBUTED and "call_a" not in session.claimed
    assert child(session, "t-child").kind == SUBAGENT  # the call was still open for its real child


def test_a_second_thread_claiming_one_spawn_call_trains_neither(session) -> None:
    spawn_turn(session, ("call_a", PROMPT))
    first = child(session, "t-1")
    second = child(session, "t-2")
    assert (second.kind, second.cause) == (UNATTRIBUTED, CONTESTED_CALL)
    assert first.contested and session.contenders() == [first]


def test_two_spawn_calls_with_one_message_are_claimed_one_each(session) -> None:
    spawn_turn(session, ("call_a", PROMPT), ("call_b", PROMPT))
    one, two = child(session, "t-1"), child(session, "t-2")
    assert (one.kind, two.kind) == (SUBAGENT, SUBAGENT)
    assert {one.parent_tool_use_id, two.parent_tool_use_id} == {"call_a", "call_b"}


def notification(thread: str, status: str = "completed") -> dict:
    body = json.dumps({"agent_path": thread, "status": {status: "done"}})
    return {"role": "user", "content": f"<subagent_notification>\n{body}\n</subagent_notification>"}


def test_a_notification_after_mains_last_turn_ends_that_childs_chain_only(session, tokenizer) -> None:
    spawn_turn(session, ("call_a", PROMPT), ("call_b", "Other."))
    done, busy = child(session, "t-done"), child(session, "t-busy", prompt="Other.")
    for agent in (done, busy):
        plan = agent.history.plan(opening(PROMPT), chat_tools([EXEC]))
        agent.history.commit(plan, [7], [-0.1], "stop", 0, {"role": "assistant", "content": "report"})
    history = [*opening("go"), {"role": "assistant", "content": "waiting"}]
    assert notified_subagents(session, history + [notification("t-done")]) == [done]
    assert notified_subagents(session, [*opening("go"), notification("t-done"), history[-1]]) == []  # older
    assert notified_subagents(session, history + [notification("t-nobody")]) == []


@pytest.mark.parametrize(
    "content",
    [
        "<subagent_notification>\nnot json\n</subagent_notification>",
        '<subagent_notification>\n{"agent_path": 7}\n</subagent_notification>',
        '<subagent_notification>\n["t1"]\n</subagent_notification>',
        'see <subagent_notification>\n{"agent_path": "t1"}\n</subagent_notification>',
        '<subagent_notification>\n{"agent_path": "t1"}',
    ],
)
def test_anything_but_a_whole_notification_names_no_thread(content: str) -> None:
    assert notified_thread({"role": "user", "content": content}) is None


def test_a_notification_names_its_thread_only_as_a_user_message() -> None:
    good = notification("t1")
    assert notified_thread(good) == "t1"
    assert notified_thread({**good, "role": "tool"}) is None
