"""The adapter's pure parts: translation, routing, ids and signatures, SSE framing, records, the outbox."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollbus.cli import main as cli_main
from rollbus.services.adapter import bodies, sse
from rollbus.services.adapter.anthropic import Message, parse_messages_request
from rollbus.services.adapter.assistant import stop_reason
from rollbus.services.adapter.attribution import answers_agent_call, claude_code
from rollbus.services.adapter.canonical import CanonicalHistory
from rollbus.services.adapter.errors import overloaded
from rollbus.services.adapter.main import add_arguments, settings_from
from rollbus.services.adapter.provenance import (
    TurnRef,
    signed_turn,
    thinking_signature,
    tool_use_id,
)
from rollbus.services.adapter.sessions import (
    MAIN,
    SIDE,
    UNATTRIBUTED,
    RequestShape,
    Sessions,
)
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.sglang_client import EngineError, parse_generation
from rollbus.services.adapter.tokens import SessionTokens
from rollbus.services.adapter.translate import IMAGE_PLACEHOLDER, to_chat
from rollbus.services.adapter.turn import policy_version
from rollbus.tokenizer import load_tokenizer
from rollbus.trajectory import Turn
from rollbus.turn_log import prompt_reference
from tests.test_adapter_support import READ_TOOL, body


def chat_of(messages, **overrides):
    request = parse_messages_request(json.dumps(body(messages, **overrides)).encode())
    return to_chat(request.system, request.messages, request.tools)


def test_system_blocks_join_and_cache_markers_vanish() -> None:
    chat = chat_of("hi")
    assert chat.messages[0] == {
        "role": "system",
        "content": "You are Claude Code, a coding agent.\n\nWork in /repo.",
    }
    assert "cache_control" not in json.dumps(chat.messages)
    assert chat.tools[0]["function"]["parameters"] == READ_TOOL["input_schema"]


def test_mid_history_system_messages_fold_into_the_next_user_turn_after_tool_results() -> None:
    chat = chat_of(
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "/a"}}],
            },
            {"role": "system", "content": "Date is Monday."},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "x", "is_error": True},
                    {"type": "text", "text": "then?"},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "Last word."}]},
        ]
    )
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "x"}
    assert chat.messages[4]["content"] == (
        "<system-reminder>\nDate is Monday.\n</system-reminder>\n\nthen?"
        "\n\n<system-reminder>\nLast word.\n</system-reminder>"
    )


def test_assistant_blocks_become_reasoning_text_and_tool_calls_with_ids_kept() -> None:
    chat = chat_of(
        [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "plan", "signature": ""},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "toolu_abc", "name": "Read", "input": {"file_path": "/a"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_abc",
                        "content": [{"type": "text", "text": "a"}, {"type": "image"}],
                    }
                ],
            },
        ]
    )
    assistant = chat.messages[2]
    assert assistant["reasoning_content"] == "plan" and assistant["content"] == "Reading."
    assert assistant["tool_calls"] == [
        {
            "id": "toolu_abc",
            "type": "function",
            "function": {"name": "Read", "arguments": {"file_path": "/a"}},
        }
    ]
    assert chat.messages[3]["content"] == f"a\n\n{IMAGE_PLACEHOLDER}"


def test_tool_use_ids_and_signatures_name_their_turn() -> None:
    ref = TurnRef("r1", "main", 3)
    ids = {tool_use_id(ref, i) for i in range(3)} | {tool_use_id(TurnRef("r1", "main", 4), 0)}
    assert len(ids) == 4 and all(i.startswith("toolu_") for i in ids)
    signature = thinking_signature(b"k" * 32, ref)
    assert signed_turn(b"k" * 32, signature) == "r1/main/3"
    assert signed_turn(b"x" * 32, signature) is None
    tampered = signature[:-1] + ("1" if signature.endswith("0") else "0")
    assert signed_turn(b"k" * 32, tampered) is None
    forged_turn = signature.replace(signature.split(".")[1], "cjEvbWFpbi85")  # "r1/main/9"
    assert signed_turn(b"k" * 32, forged_turn) is None
    assert signed_turn(b"k" * 32, "") is None and signed_turn(b"k" * 32, "rb1.!!.x") is None


@pytest.mark.parametrize(
    "finish, calls, matched, expected",
    [
        ("length", True, None, ("max_tokens", None)),
        ("stop", True, 1, ("tool_use", None)),
        ("stop", False, "END", ("stop_sequence", "END")),
        ("stop", False, 248046, ("end_turn", None)),
    ],
)
def test_stop_reason(finish, calls, matched, expected) -> None:
    assert stop_reason(finish, calls, matched) == expected


def test_sse_frames_name_their_type_and_errors_keep_the_anthropic_shape() -> None:
    frame = sse.event("ping", {}).decode()
    assert frame == 'event: ping\ndata: {"type":"ping"}\n\n'
    blocks = [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/ä"}}]
    frames = [f.decode() for f in sse.content_events(blocks)]
    delta = json.loads(frames[1].split("data: ", 1)[1])
    assert json.loads(delta["delta"]["partial_json"]) == {"file_path": "/ä"}
    error = json.loads(sse.error(overloaded("busy", 2)).decode().split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}


def test_prompt_reference_only_when_the_previous_stream_is_a_prefix() -> None:
    first = Turn([1, 2, 3], [4, 5], [-0.1, -0.2], "stop", 0, chain_id="main", turn_index=0)
    extends = Turn([1, 2, 3, 4, 5, 9, 10], [6], [-0.3], "stop", 0, chain_id="main", turn_index=1)
    diverges = Turn([1, 2, 3, 4, 7, 9], [6], [-0.3], "stop", 0, chain_id="main", turn_index=1)
    assert prompt_reference(first.prompt_ids, None) == (None, [1, 2, 3])
    assert prompt_reference(extends.prompt_ids, first) == (0, [9, 10])
    assert prompt_reference(diverges.prompt_ids, first) == (None, [1, 2, 3, 4, 7, 9])


def test_routing_main_subagent_and_side() -> None:
    tokenizer = load_tokenizer("qwen3.6")
    sessions = Sessions(lambda name: CanonicalHistory(tokenizer, chain_name=name))
    session = sessions.get("r1")
    tools = [{"type": "function", "function": {"name": "Read", "parameters": {}}}]
    main = claude_code(session, RequestShape(None, "sys", [{"role": "user", "content": "a"}], tools))
    assert (main.kind, main.chain_id) == (MAIN, "main")
    by_header = claude_code(session, RequestShape("ab12", "other", [{"role": "user", "content": "b"}], tools))
    assert (by_header.kind, by_header.chain_id, by_header.parent) == (UNATTRIBUTED, "agent-ab12", main)
    side = claude_code(session, RequestShape(None, "title please", [{"role": "user", "content": "c"}], []))
    assert side.kind == SIDE and side.chain_id == "side-0" and "side-0" not in session.agents
    assert claude_code(session, RequestShape(None, "sys", [{"role": "user", "content": "d"}], tools)) is main


class HandClock:
    """A clock the test moves by hand: expiry is about which session is older, not about waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_sessions_expire_after_no_request_and_no_turn_in_flight() -> None:
    tokenizer = load_tokenizer("qwen3.6")
    clock = HandClock()
    sessions = Sessions(lambda name: CanonicalHistory(tokenizer, chain_name=name), clock)
    tools = [{"type": "function", "function": {"name": "Read", "parameters": {}}}]
    quiet, asked, working = (sessions.get(r) for r in ("quiet", "asked", "working"))
    agent = claude_code(working, RequestShape(None, "sys", [{"role": "user", "content": "a"}], tools))
    clock.now += 60
    sessions.get("asked")
    async with agent.lock:  # a turn longer than the timeout is not idleness
        assert [s.rollout_id for s in sessions.expire(idle_since=clock.now - 30)] == ["quiet"]
    assert "quiet" not in sessions and "asked" in sessions and "working" in sessions
    clock.now += 31
    assert {s.rollout_id for s in sessions.expire(idle_since=clock.now - 30)} == {"asked", "working"}
    assert sessions.expire(idle_since=clock.now) == [] and sessions.get("quiet") is not quiet


def test_tokens_never_used_are_found_and_revoked_tokens_stop_working() -> None:
    clock = HandClock()
    tokens = SessionTokens(b"k" * 32, clock=clock)
    used, unused = tokens.issue("r-used"), tokens.issue("r-unused")
    clock.now += 10
    assert tokens.unused(clock.now - 20, in_use=set()) == []
    assert tokens.unused(clock.now, in_use={"r-used"}) == ["r-unused"]
    clock.now += 1
    tokens.revoke("r-unused")
    assert tokens.rollout_for(unused) is None and tokens.rollout_for(used) == "r-used"
    assert tokens.unused(clock.now, in_use={"r-used"}) == []


def test_answers_agent_call_looks_at_the_last_assistant_turn() -> None:
    call = {"id": "t9", "type": "function", "function": {"name": "Agent", "arguments": {}}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert not answers_agent_call(messages)
    assert answers_agent_call(messages + [{"role": "tool", "tool_call_id": "t9", "content": "report"}])


def test_engine_answers_are_checked() -> None:
    good = {
        "text": "hi",
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "length"},
            "prompt_tokens": 3,
            "weight_version": "7",
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]],
        },
    }
    generation = parse_generation(good, "rb-1", 10)
    assert (generation.output_ids, generation.output_logprobs, generation.finish_type) == (
        [5, 6],
        [-0.5, -1.5],
        "length",
    )
    assert policy_version(generation.weight_version, 0) == 7 and policy_version("v-abc", 3) == 3
    with pytest.raises(EngineError, match="disagree"):
        parse_generation({**good, "output_ids": [5]}, "rb-1", 10)
    with pytest.raises(EngineError, match="not a generation"):
        parse_generation({"text": "hi"}, "rb-1", 10)


def test_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="history_mode"):
        AdapterSettings(history_mode="magic")
    with pytest.raises(ValueError, match="max_concurrency"):
        AdapterSettings(max_concurrency=0)
    with pytest.raises(ValueError, match="session_idle_timeout"):
        AdapterSettings(session_idle_timeout=-1)
    with pytest.raises(ValueError, match="signing_key must not be empty"):
        AdapterSettings(signing_key=b"")
    with pytest.raises(ValueError, match="at least 16 bytes, not 15"):
        AdapterSettings(signing_key=b"k" * 15)
    assert AdapterSettings(signing_key=b"k" * 16, session_idle_timeout=0).session_idle_timeout == 0


def adapter_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollbus adapter")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_a_shared_signing_key_survives_a_restart(monkeypatch) -> None:
    """Signatures written before a restart are recognised after it when the key is configured;
    without one every process has its own random key."""
    ref = TurnRef("r1", "main", 2)
    monkeypatch.setenv("ROLLBUS_ADAPTER_SIGNING_KEY", "a-shared-key-of-enough-bytes")
    before, after = settings_from(adapter_args([])), settings_from(adapter_args([]))
    assert before.signing_key == b"a-shared-key-of-enough-bytes"
    assert signed_turn(after.signing_key, thinking_signature(before.signing_key, ref)) == "r1/main/2"
    flagged = settings_from(adapter_args(["--signing-key", "another-key-16-bytes"]))
    assert signed_turn(flagged.signing_key, thinking_signature(before.signing_key, ref)) is None
    monkeypatch.delenv("ROLLBUS_ADAPTER_SIGNING_KEY")
    own, other = settings_from(adapter_args([])), settings_from(adapter_args([]))
    assert signed_turn(other.signing_key, thinking_signature(own.signing_key, ref)) is None


@pytest.mark.parametrize("key", ["", "short-secret"])
def test_a_bad_signing_key_stops_the_adapter_without_showing_it(monkeypatch, capsys, key) -> None:
    monkeypatch.setenv("ROLLBUS_ADAPTER_SIGNING_KEY", key)
    with pytest.raises(SystemExit) as stopped:
        cli_main(["adapter"])
    assert stopped.value.code == 2
    message = capsys.readouterr().err
    assert message.startswith("rollbus adapter: error: ROLLBUS_ADAPTER_SIGNING_KEY='***'")
    assert "signing_key must" in message and len(message.strip().splitlines()) == 1
    assert ("empty" if not key else "at least 16 bytes") in message and (not key or key not in message)


def test_message_blocks_of_a_string_content() -> None:
    assert [b.type for b in Message(role="user", content="hi").blocks()] == ["text"]


def test_folding_is_stable_as_the_cli_grows_the_conversation() -> None:
    """Each request's translation must be a prefix of the next one's, or the chain would restart."""

    def call(n: int) -> list[dict]:
        tool_use = {"type": "tool_use", "id": f"t{n}", "name": "Read", "input": {"file_path": "/a"}}
        result = {"type": "tool_result", "tool_use_id": f"t{n}", "content": "x"}
        return [{"role": "assistant", "content": [tool_use]}, {"role": "user", "content": [result]}]

    reminder = {"role": "system", "content": "Available agent types: ..."}
    requests = [[{"role": "user", "content": "Read hello.py"}, reminder]]  # what the CLI sends first
    requests.append(requests[-1] + call(1))
    requests.append(requests[-1][:] + [call(2)[0], reminder, call(2)[1]])  # a reminder with a tool result
    requests.append(requests[-1] + call(3))
    chats = [chat_of(messages).messages for messages in requests]
    for before, after in zip(chats, chats[1:], strict=False):
        assert after[: len(before)] == before
    assert "<system-reminder>" in chats[0][1]["content"] and len(chats[0]) == 2


@st.composite
def growing_conversations(draw) -> list[list[dict]]:
    """Requests as the CLI grows them: each adds an assistant turn, reminders and the tool results."""

    def reminders(where: str) -> list[dict]:
        n = draw(st.integers(0, 2))
        return [{"role": "system", "content": f"reminder {where} {i}"} for i in range(n)]

    first = [*reminders("start"), {"role": "user", "content": "Read hello.py"}, *reminders("first")]
    requests = [first]
    for k in range(draw(st.integers(1, 4))):
        tool_use = {"type": "tool_use", "id": f"t{k}", "name": "Read", "input": {"file_path": f"/f{k}"}}
        result = [{"type": "tool_result", "tool_use_id": f"t{k}", "content": "x"}]
        if draw(st.booleans()):
            result.append({"type": "text", "text": "and also this"})
        step = [
            {"role": "assistant", "content": [tool_use]},
            *reminders(f"before {k}"),
            {"role": "user", "content": result},
            *reminders(f"after {k}"),
        ]
        requests.append(requests[-1] + step)
    return requests


@settings(max_examples=60, deadline=None)
@given(growing_conversations())
def test_every_growing_conversation_translates_to_growing_chats(requests) -> None:
    chats = [chat_of(messages).messages for messages in requests]
    for before, after in zip(chats, chats[1:], strict=False):
        assert after[: len(before)] == before
    assert not any(m["role"] == "system" for chat in chats for m in chat[1:])


JSON_EDGES = [
    b'{"a": 1e400, "b": -1e-400, "c": -0, "d": -0.0, "e": 0.1e1, "f": 5e-324}',
    b'{"a": NaN, "b": Infinity}',
    b'{"id": 123456789012345678901234567890, "u": 18446744073709551615, "s": "12345678901234567890"}',
    b'{"t": "\\ud800 lone", "pair": "\\ud83d\\ude00"}',
    b'{"a": 1, "a": 2}',
    b"\xef\xbb\xbf" + b'{"bom": true}',
    '{"utf16": "\u00e9"}'.encode("utf-16"),
    b'{"raw": "\xed\xa0\x80"}',  # a surrogate encoded as UTF-8: the standard decoder's surrogatepass reads it
    b'{"bad": "\xff"}',
    b'{"ctl": "a\x01b"}',
    b"[" * 2000 + b"]" * 2000,
    b'{"x": [' + b"0.30000000000000004, " * 50 + b"1]}",
    b'{"trailing": 1} x',
]


@pytest.mark.parametrize("raw", JSON_EDGES)
def test_request_and_engine_json_read_as_the_standard_decoder_reads_it(raw: bytes) -> None:
    """The faster decoder of request bodies and engine answers (orjson where it agrees) gives the standard
    decoder's values, types and errors."""

    def outcome(loads):
        try:
            return "ok", repr(loads(raw))
        except (ValueError, RecursionError) as exc:
            return "error", type(exc).__name__

    assert outcome(bodies.loads_exact) == outcome(json.loads)
