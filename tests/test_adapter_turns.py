"""Turns through the adapter against the real rollbus engine (scripted policy, real logprobs).

Each test uses its own rollout id, so the engine replays its script from the start for it.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import httpx
import pytest

from rollbus.services.adapter.app import create_app
from rollbus.services.adapter.expiry import TASK_NAME
from rollbus.services.adapter.parsing import parse_output
from rollbus.services.adapter.provenance import signed_turn
from rollbus.tokenizer import load_tokenizer
from tests.test_adapter_support import (
    BusPublisher,
    adapter_client,
    body,
    message_from_events,
    scripted_adapter,
    served,
    settings,
    sse_events,
)
from tests.waiting import until

READ_CALL = (
    "The user wants the file.\n</think>\n\nI'll read it.\n\n<tool_call>\n<function=Read>\n"
    "<parameter=file_path>\n/repo/app.py\n</parameter>\n</function>\n</tool_call>"
)
AGENT_CALL = (
    "Delegate the review.\n</think>\n\n<tool_call>\n<function=Agent>\n<parameter=description>\nreview\n"
    "</parameter>\n<parameter=prompt>\nReview app.py\n</parameter>\n</function>\n</tool_call>"
)
SCRIPT = {
    "turns": [READ_CALL, AGENT_CALL, "Done reviewing.\n</think>\n\nThe file defines main()."],
    "subagent_turns": ["Looking.\n</think>\n\nSub-agent report: all good."],
    "side_text": "\n</think>\n\nFix app.py",
}
SUB_SYSTEM = [{"type": "text", "text": "You are a review sub-agent."}]


@pytest.fixture
async def adapter(engine_url):
    async with scripted_adapter(engine_url) as client:
        yield client


def rollout() -> dict[str, str]:
    return {"x-api-key": f"r-{uuid.uuid4().hex[:8]}"}


async def streamed(client, request, headers) -> dict:
    response = await client.post("/v1/messages?beta=true", json=request, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    check_event_order([name for name, _ in events])
    return message_from_events(events)


def check_event_order(names: list[str]) -> None:
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks = [n for n in names[1:-2] if n != "ping"]
    while blocks:
        assert blocks[0] == "content_block_start", names
        end = blocks.index("content_block_stop")
        assert set(blocks[1:end]) <= {"content_block_delta"} and end > 1, names
        blocks = blocks[end + 1 :]


def echo(message: dict) -> dict:
    """The assistant message as the CLI sends it back in history."""
    return {"role": "assistant", "content": message["content"]}


def answered(message: dict, text: str) -> dict:
    results = [
        {"type": "tool_result", "tool_use_id": b["id"], "content": [{"type": "text", "text": text}]}
        for b in message["content"]
        if b["type"] == "tool_use"
    ]
    return {"role": "user", "content": results}


async def test_tool_use_turn_streams_blocks_and_publishes_exact_tokens(adapter) -> None:
    headers = rollout()
    request = body("Read /repo/app.py")
    message = await streamed(adapter, request, headers)
    kinds = [b["type"] for b in message["content"]]
    assert kinds == ["thinking", "text", "tool_use"] and message["stop_reason"] == "tool_use"
    thinking, text, call = message["content"]
    assert call["name"] == "Read" and call["input"] == {"file_path": "/repo/app.py"}
    key = adapter.app.state.adapter.kit.settings.signing_key
    assert signed_turn(key, thinking["signature"]) == f"{headers['x-api-key']}/main/0"

    opened, turn = (
        adapter.publisher.of("sessions", headers["x-api-key"]),
        adapter.publisher.of("turns", headers["x-api-key"]),
    )
    assert [(e["kind"], e["chain_id"], e["chain_kind"]) for e in opened] == [("opened", "main", "main")]
    assert len(turn) == 1 and turn[0]["prompt_ref_turn"] is None
    turn = turn[0]
    count = await adapter.post("/v1/messages/count_tokens", json=request, headers=headers)
    assert turn["prompt_tokens"] == len(turn["prompt_ids"]) == count.json()["input_tokens"]
    assert message["usage"]["input_tokens"] == turn["prompt_tokens"]
    assert message["usage"]["output_tokens"] == len(turn["output_ids"]) == len(turn["output_logprobs"])
    assert all(lp <= 0.0 for lp in turn["output_logprobs"]) and turn["finish_reason"] == "stop"

    decoded = load_tokenizer("qwen3.6").decode(turn["output_ids"], skip_special_tokens=False)
    assert decoded == READ_CALL + "<|im_end|>"
    tools = [
        {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"]}}
        for t in request["tools"]
    ]
    parsed = parse_output(decoded, tools)
    assert parsed.reasoning == thinking["thinking"] and parsed.text == text["text"] == "I'll read it."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(call["name"], call["input"])]


async def test_echoed_history_extends_the_chain_by_a_suffix(adapter) -> None:
    headers = rollout()
    first = body("Read /repo/app.py")
    one = await streamed(adapter, first, headers)
    history = first["messages"] + [echo(one), answered(one, "def main(): ...")]
    two = await streamed(adapter, body(history), headers)
    assert [b["name"] for b in two["content"] if b["type"] == "tool_use"] == ["Agent"]

    turns = adapter.publisher.of("turns", headers["x-api-key"])
    assert [t["turn_index"] for t in turns] == [0, 1] and turns[1]["prompt_ref_turn"] == 0
    resolved = turns[0]["prompt_ids"] + turns[0]["output_ids"] + turns[1]["prompt_ids"]
    assert len(resolved) == turns[1]["prompt_tokens"] == two["usage"]["input_tokens"]
    suffix = load_tokenizer("qwen3.6").decode(turns[1]["prompt_ids"])
    assert "def main(): ..." in suffix and "Read /repo/app.py" not in suffix
    assert len(adapter.publisher.of("sessions", headers["x-api-key"])) == 1  # still the one chain


async def test_non_streaming_answer_is_the_same_message(adapter) -> None:
    response = await adapter.post(
        "/v1/messages", json=body("Read /repo/app.py", stream=False), headers=rollout()
    )
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    message = response.json()
    assert message["type"] == "message" and message["role"] == "assistant"
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use"]
    assert message["stop_reason"] == "tool_use" and message["usage"]["output_tokens"] > 0


async def test_max_tokens_cuts_the_turn_and_says_so(adapter) -> None:
    headers = rollout()
    message = await streamed(adapter, body("Read /repo/app.py", max_tokens=4), headers)
    assert message["stop_reason"] == "max_tokens" and message["usage"]["output_tokens"] == 4
    (turn,) = adapter.publisher.of("turns", headers["x-api-key"])
    assert turn["finish_reason"] == "length" and len(turn["output_ids"]) == 4


async def dispatch_agent(adapter, headers) -> dict:
    """Main reads app.py, then calls Agent("Review app.py") (the script's first two main turns)."""
    history = body("Read /repo/app.py")["messages"]
    one = await streamed(adapter, body(history), headers)
    history += [echo(one), answered(one, "def main(): ...")]
    return await streamed(adapter, body(history), headers)


async def test_subagent_by_header_and_side_calls_get_their_own_chains(adapter) -> None:
    headers = rollout()
    rollout_id = headers["x-api-key"]
    call = await dispatch_agent(adapter, headers)
    sub = await streamed(
        adapter, body("Review app.py", system=SUB_SYSTEM), {**headers, "x-claude-code-agent-id": "a1b2"}
    )
    assert sub["content"][-1]["text"] == "Sub-agent report: all good."
    side = await streamed(adapter, body("Generate a title", tools=[]), headers)
    assert side["content"][-1]["text"] == "Fix app.py" and side["stop_reason"] == "end_turn"

    kinds = {t["chain_id"]: t["chain_kind"] for t in adapter.publisher.of("turns", rollout_id)}
    assert kinds == {"main": "main", "agent-a1b2": "subagent", "side-0": "side"}
    sessions = {(e["chain_id"], e["kind"]): e for e in adapter.publisher.of("sessions", rollout_id)}
    opened = sessions[("agent-a1b2", "opened")]
    assert opened["parent_chain_id"] == "main" and opened["agent_id"] == "a1b2"
    assert opened["parent_tool_use_id"] == next(b["id"] for b in call["content"] if b["type"] == "tool_use")
    assert sessions[("side-0", "frozen")]["reason"] == "side"
    side_events = [(t, r.get("kind")) for t, _, r in adapter.publisher.events if r["chain_id"] == "side-0"]
    assert side_events == [("sessions", "opened"), ("turns", None), ("sessions", "frozen")]


async def test_subagent_without_header_is_found_by_its_system_prompt(adapter) -> None:
    headers = rollout()
    await dispatch_agent(adapter, headers)
    first = body("Review app.py", system=SUB_SYSTEM)
    sub = await streamed(adapter, first, headers)
    # its second request extends its own history, not main's
    await streamed(
        adapter,
        body(first["messages"] + [echo(sub), {"role": "user", "content": "more"}], system=SUB_SYSTEM),
        headers,
    )
    chains = [
        (t["chain_id"], t["chain_kind"], t["turn_index"])
        for t in adapter.publisher.of("turns", headers["x-api-key"])
    ]
    assert chains[:2] == [("main", "main", 0), ("main", "main", 1)]
    assert chains[2][1:] == ("subagent", 0) and chains[3] == (chains[2][0], "subagent", 1)


async def test_conversations_no_agent_call_started_are_unattributed(adapter) -> None:
    """What a curl from the agent's Bash tool can send with the token: never a trainable sub-agent."""
    headers = rollout()
    rollout_id = headers["x-api-key"]
    early = {**headers, "x-claude-code-agent-id": "curl1"}
    await streamed(adapter, body("Review app.py", system=SUB_SYSTEM), early)  # before any Agent call
    await dispatch_agent(adapter, headers)
    wrong_prompt = {**headers, "x-claude-code-agent-id": "curl2"}
    await streamed(adapter, body("Say I solved it", system=SUB_SYSTEM), wrong_prompt)
    await streamed(
        adapter, body("Review app.py", system=SUB_SYSTEM), {**headers, "x-claude-code-agent-id": "real"}
    )
    again = {**headers, "x-claude-code-agent-id": "curl3"}  # the Agent call is already answered
    await streamed(adapter, body("Review app.py", system=SUB_SYSTEM), again)
    kinds = {t["chain_id"]: t["chain_kind"] for t in adapter.publisher.of("turns", rollout_id)}
    assert kinds == {
        "agent-curl1": "unattributed",
        "main": "main",
        "agent-curl2": "unattributed",
        "agent-real": "subagent",
        "agent-curl3": "unattributed",
    }
    # a second claim of one call: which claimant is the CLI's is unproven, so neither trains
    ended = [(e["chain_id"], e["kind"], e["reason"]) for e in adapter.publisher.of("sessions", rollout_id)]
    assert ("agent-real", "frozen", "ambiguous") in ended


async def test_chains_per_rollout_are_capped(engine_url) -> None:
    publisher = BusPublisher()
    async with adapter_client(settings(engine_url, max_chains_per_rollout=2), publisher) as client:
        headers = rollout()
        for n in range(2):
            await streamed(client, body(f"title {n}", tools=[]), headers)
        refused = await client.post(
            "/v1/messages", json=body("title 3", tools=[], stream=False), headers=headers
        )
    assert refused.status_code == 400 and "2 chains" in refused.json()["error"]["message"]
    assert refused.headers["x-should-retry"] == "false"
    assert len(publisher.of("turns", headers["x-api-key"])) == 2


async def test_agent_result_freezes_the_subagent_and_compaction_starts_a_chain(adapter) -> None:
    headers = rollout()
    rollout_id = headers["x-api-key"]
    history = body("Read /repo/app.py")["messages"]
    one = await streamed(adapter, body(history), headers)
    history += [echo(one), answered(one, "def main(): ...")]
    two = await streamed(adapter, body(history), headers)
    await streamed(
        adapter, body("Review app.py", system=SUB_SYSTEM), {**headers, "x-claude-code-agent-id": "s1"}
    )
    history += [echo(two), answered(two, "Sub-agent report: all good.")]
    three = await streamed(adapter, body(history), headers)
    assert three["stop_reason"] == "end_turn"
    frozen = [e for e in adapter.publisher.of("sessions", rollout_id) if e["kind"] == "frozen"]
    assert [(e["chain_id"], e["reason"], e["turn_count"]) for e in frozen] == [("agent-s1", "subagent", 1)]

    compacted = body("This session is being continued from a previous conversation. Summary: read app.py.")
    await streamed(adapter, compacted, headers)
    events = [(e["chain_id"], e["kind"], e["reason"]) for e in adapter.publisher.of("sessions", rollout_id)]
    assert events[-2:] == [("main", "frozen", "compaction"), ("main.1", "opened", "compaction")]
    assert adapter.publisher.of("turns", rollout_id)[-1]["chain_id"] == "main.1"

    closed = await adapter.post(
        f"/admin/sessions/{rollout_id}/close", headers={"authorization": "Bearer adm"}
    )
    assert closed.status_code == 200 and closed.json()["closed"] == ["main.1"]
    assert adapter.publisher.of("sessions", rollout_id)[-1]["kind"] == "closed"


def expiry_tasks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if t.get_name() == TASK_NAME]


async def test_idle_sessions_close_their_chains_and_lose_their_tokens(engine_url) -> None:
    publisher = BusPublisher()
    admin = {"authorization": "Bearer adm"}
    idle = settings(engine_url, admin_token="adm", open_sessions=False, session_idle_timeout=1.0)
    async with adapter_client(idle, publisher) as client:
        assert len(expiry_tasks()) == 1
        rollout_id, unused_id = f"r-{uuid.uuid4().hex[:8]}", f"r-{uuid.uuid4().hex[:8]}"
        tokens = [
            (await client.post("/admin/sessions", json={"rollout_id": r}, headers=admin)).json()["token"]
            for r in (rollout_id, unused_id)
        ]
        await streamed(client, body("Read /repo/app.py"), {"x-api-key": tokens[0]})
        await until(lambda: publisher.of("sessions", rollout_id)[-1]["kind"] == "closed", "the idle close")
        events = [(e["chain_id"], e["kind"], e["reason"]) for e in publisher.of("sessions", rollout_id)]
        assert events == [("main", "opened", "first"), ("main", "closed", "idle_timeout")]
        for token in tokens:
            again = await client.post("/v1/messages", json=body("hi"), headers={"x-api-key": token})
            assert again.status_code == 401
        gone = await client.post(f"/admin/sessions/{rollout_id}/close", headers=admin)
        assert gone.status_code == 404
        assert publisher.of("sessions", unused_id) == []
    assert expiry_tasks() == []  # stopped with the app
    async with adapter_client(settings(engine_url, session_idle_timeout=0), BusPublisher()):
        assert expiry_tasks() == []


async def test_bus_outage_keeps_turns_then_refuses_with_503(engine_url) -> None:
    publisher = BusPublisher()
    async with adapter_client(settings(engine_url, outbox_capacity=1), publisher) as client:
        publisher.down = True
        headers = rollout()
        kept = await client.post("/v1/messages", json=body("Read /repo/app.py"), headers=headers)
        assert kept.status_code == 200 and sse_events(kept.text)[-1][0] == "message_stop"
        refused = await client.post("/v1/messages", json=body("Read /repo/app.py"), headers=rollout())
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "api_error"
        assert refused.headers["retry-after"] and refused.headers["x-should-retry"] == "true"
        publisher.down = False
        outbox = client.app.state.adapter.kit.outbox
        await outbox.flush(timeout=30)
        assert not outbox.backlog
        assert [t for t, _, _ in publisher.events] == ["sessions", "turns"]
        assert publisher.of("turns", headers["x-api-key"])[0]["turn_index"] == 0


async def test_end_to_end_over_http_publishes_before_the_stream_ends(engine_url) -> None:
    publisher = BusPublisher()
    app = create_app(settings(engine_url), publisher)
    headers = rollout()
    async with served(app) as (url, _), httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert (await client.head("/")).status_code == 200
        seen_at_first_block = None
        names = []
        async with client.stream(
            "POST", "/v1/messages?beta=true", json=body("Read /repo/app.py"), headers=headers
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    names.append(line.removeprefix("event: "))
                    if names[-1] == "content_block_start" and seen_at_first_block is None:
                        seen_at_first_block = len(publisher.of("turns", headers["x-api-key"]))
    check_event_order(names)
    assert seen_at_first_block == 1  # the turn was on the bus before any content reached the client


async def test_the_real_claude_code_cli_runs_a_session_with_a_subagent(engine_url, tmp_path) -> None:
    """Claude Code 2.1.197 against the adapter: Read (fails: no such file), Agent, sub-agent, answer."""
    from rollbus.claude_cli import CliNotInstalled, binary_path, build_command, build_env

    try:
        binary = binary_path()
    except CliNotInstalled as exc:
        pytest.skip(str(exc))  # scripts/bootstrap.sh installs it
    publisher = BusPublisher()
    app = create_app(settings(engine_url, context_length=200_000, max_new_tokens=4096), publisher)
    rollout_id = f"cli-{uuid.uuid4().hex[:8]}"
    (tmp_path / "home").mkdir()
    async with served(app) as (url, _):
        cmd = build_command("Review app.py", model="qwen3.6-test", max_turns=6, binary=str(binary))
        env = build_env(
            url, rollout_id, model="qwen3.6-test", home=str(tmp_path / "home"), path=os.environ["PATH"]
        )
        cli = await asyncio.create_subprocess_exec(
            *cmd, env=env, cwd=tmp_path, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await asyncio.wait_for(cli.communicate(), 300)
    assert cli.returncode == 0, err.decode()[-2000:]
    result = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")][-1]
    assert result["type"] == "result" and result["result"] == "The file defines main()."

    turns = [
        (t["chain_id"], t["chain_kind"], t["turn_index"], t["prompt_ref_turn"])
        for t in publisher.of("turns", rollout_id)
    ]
    main = [t for t in turns if t[1] == "main"]
    assert main == [("main", "main", 0, None), ("main", "main", 1, 0), ("main", "main", 2, 1)]
    sub = [t for t in turns if t[1] == "subagent"]
    assert len(sub) == 1 and sub[0][0].startswith("agent-")
    lifecycle = [
        (e["chain_id"], e["kind"], e["reason"], e["parent_chain_id"])
        for e in publisher.of("sessions", rollout_id)
    ]
    assert (sub[0][0], "opened", "first", "main") in lifecycle
    assert (sub[0][0], "frozen", "subagent", "main") in lifecycle


async def test_a_record_too_large_for_the_bus_fails_its_turn_and_commits_nothing(engine_url) -> None:
    """Checked when queued, before the turn is committed: memory and bus agree there is no such turn."""
    publisher = BusPublisher()
    async with adapter_client(settings(engine_url), publisher, raise_app_exceptions=False) as client:
        client.app.state.adapter.kit.outbox.max_event_bytes = 200
        headers = rollout()
        response = await client.post(
            "/v1/messages", json=body("Read /repo/app.py", stream=False), headers=headers
        )
        session = client.app.state.adapter.sessions.get(headers["x-api-key"])
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "api_error" and "RecordTooLarge" in error["message"] and "200" in error["message"]
    assert session.agents["main"].history.turns == []
    assert publisher.events == []


async def test_rerender_history_mode_renders_every_prompt_whole(engine_url) -> None:
    publisher = BusPublisher()
    async with adapter_client(settings(engine_url, history_mode="rerender"), publisher) as client:
        headers = rollout()
        first = body("Read /repo/app.py")
        one = await streamed(client, first, headers)
        two = await streamed(client, body(first["messages"] + [echo(one), answered(one, "ok")]), headers)
        count = await client.post(
            "/v1/messages/count_tokens",
            json=body(first["messages"] + [echo(one), answered(one, "ok")]),
            headers=headers,
        )
    turns = publisher.of("turns", headers["x-api-key"])
    assert [(t["chain_id"], t["turn_index"]) for t in turns] == [("main", 0), ("main", 1)]
    assert two["usage"]["input_tokens"] == turns[1]["prompt_tokens"] == count.json()["input_tokens"]
