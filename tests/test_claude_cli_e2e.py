"""The real Claude Code CLI, inside the real bwrap sandbox, fixes the example repo against a scripted server.

The scripted replies come from ``examples/scripts/fix_calc.json`` parsed with SGLang's own qwen3 reasoning
and qwen3_coder tool-call parsers, as the adapter parses model output; so this also proves the example
script drives the real CLI to the fix. It does not involve the adapter or a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollbus import claude_cli
from rollbus.sandbox import BwrapSandbox, bwrap_usable, git_diff, prepare_repo
from tests.fake_anthropic import FakeAnthropic, Reply, text, tool_use

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CLI_IN_SANDBOX = claude_cli.SANDBOX_BINARY
MODEL = "scripted-model"
TOKEN = "test-token-e2e"

pytestmark = pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")


def scripted_replies() -> list[Reply]:
    """The example script's turns as Anthropic replies: reasoning dropped, tool calls as tool_use blocks."""
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    def tool(name: str, *params: str) -> Tool:
        schema = {"type": "object", "properties": {p: {"type": "string"} for p in params}}
        return Tool(function=Function(name=name, parameters=schema))

    tools = [tool("Read", "file_path"), tool("Edit", "file_path", "old_string", "new_string")]
    replies = []
    for turn, raw in enumerate(json.loads((EXAMPLES / "scripts" / "fix_calc.json").read_text())["turns"]):
        # the template's generation prompt opens <think>, so each output starts inside the reasoning
        _, visible = ReasoningParser("qwen3", force_reasoning=True).parse_non_stream(raw)
        normal, calls = FunctionCallParser(tools, "qwen3_coder").parse_non_stream(visible)
        blocks = [text(normal.strip())] if normal.strip() else []
        blocks += [tool_use(f"toolu_{turn}_{c.tool_index}", c.name, json.loads(c.parameters)) for c in calls]
        replies.append(Reply(blocks, "tool_use" if calls else "end_turn"))
    return replies


def tool_results(request_body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """tool_use id -> tool_result block, from the last (user) message of a request."""
    content = request_body["messages"][-1]["content"]
    blocks = content if isinstance(content, list) else []
    return {b["tool_use_id"]: b for b in blocks if b.get("type") == "tool_result"}


def result_text(block: dict[str, Any]) -> str:
    content = block["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


@pytest.fixture(scope="module")
def cli_binary() -> Path:
    return claude_cli.fetch()


async def test_real_cli_fixes_example_repo_in_bwrap(cli_binary: Path, tmp_path: Path) -> None:
    replies = scripted_replies()
    read_id, edit_id = replies[0].blocks[-1]["id"], replies[1].blocks[-1]["id"]
    workdir = prepare_repo(EXAMPLES / "buggy_repo", tmp_path / "repo")
    sandbox = await BwrapSandbox.create(workdir, network="loopback", ro_binds={cli_binary: CLI_IN_SANDBOX})
    async with FakeAnthropic(replies) as server:
        cmd = claude_cli.build_command(
            "Make the tests in /workspace pass.", model=MODEL, max_turns=6, binary=CLI_IN_SANDBOX
        )
        env = claude_cli.build_env(server.url, TOKEN, model=MODEL, home=sandbox.home)
        episode = await sandbox.run(cmd, env, timeout=300)
    try:
        assert (episode.exit_code, episode.timed_out) == (0, False), episode.stderr
        final = json.loads(episode.stdout.strip().splitlines()[-1])
        assert final["type"] == "result" and final["is_error"] is False

        assert "range(1, n + 1)" in (workdir / "calc.py").read_text()
        patch = git_diff(workdir)
        assert "-    return sum(range(1, n))" in patch and "+    return sum(range(1, n + 1))" in patch

        calls = server.message_requests()
        assert len(calls) == len(replies)
        assert all(c.headers["authorization"] == f"Bearer {TOKEN}" for c in calls)
        offered = {tool["name"] for tool in calls[0].body["tools"]}
        assert {"Read", "Edit", "Bash"} <= offered and not offered & {"WebFetch", "WebSearch"}
        read_result = tool_results(calls[1].body)[read_id]
        assert "return sum(range(1, n))" in result_text(read_result) and not read_result.get("is_error")
        assert not tool_results(calls[2].body)[edit_id].get("is_error")

        tests_after = await sandbox.run(["python3", "-m", "unittest", "-q"], {"PATH": "/usr/bin:/bin"})
        assert tests_after.exit_code == 0, tests_after.stderr
    finally:
        await sandbox.close()


async def test_build_env_and_tools_shape_the_requests(cli_binary: Path, tmp_path: Path) -> None:
    """What our command line and environment change on the wire (checked against the real CLI)."""
    workdir = prepare_repo(EXAMPLES / "buggy_repo", tmp_path / "repo")
    sandbox = await BwrapSandbox.create(workdir, network="loopback", ro_binds={cli_binary: CLI_IN_SANDBOX})
    async with FakeAnthropic([Reply([text("Nothing to do.")], "end_turn")]) as server:
        cmd = claude_cli.build_command(
            "Say hi.", model=MODEL, max_turns=2, binary=CLI_IN_SANDBOX, tools=["Read", "Edit"]
        )
        env = claude_cli.build_env(
            server.url + "/prefix", TOKEN, model=MODEL, home=sandbox.home, max_output_tokens=1234
        )
        episode = await sandbox.run(cmd, env, timeout=300)
    await sandbox.close()
    assert episode.exit_code == 0, episode.stderr
    [call] = [r for r in server.requests if r.method == "POST"]
    assert call.path == "/prefix/v1/messages"
    assert sorted(tool["name"] for tool in call.body["tools"]) == ["Edit", "Read"]
    assert (call.body["model"], call.body["max_tokens"]) == (MODEL, 1234)
    assert "cache_control" not in json.dumps(call.body)  # DISABLE_PROMPT_CACHING
    assert "x-anthropic-billing-header" not in json.dumps(call.body["system"])  # ATTRIBUTION_HEADER=0
