"""The real Codex CLI, in bwrap, against the real adapter's Responses route and the scripted engine, onto a
real broker: what Codex does on disk, and what training would see on the bus.

One adapter and one engine (``runner/codex_fix.json``) serve the module; each test is its own rollout.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from rollbus import codex_cli
from rollbus.sandbox import git_diff
from tests.e2e_support import SCRIPTS, Rig, play_codex, rollout_events, script_turns, stream_events
from tests.test_e2e_claude_code import assert_trains_every_sampled_token, decoded_outputs, session_kinds

pytestmark = pytest.mark.kafka

FIX = "The tests in this directory fail. Fix the bug."
IM_END = "<|im_end|>"
FIXED_LINE = "return sum(range(1, n + 1))"
RIG_SCRIPT = SCRIPTS / "runner" / "codex_fix.json"  # the conftest rig replays it
ITEM_DONE = b"event: response.output_item.done\n"


class CuttingProxy:
    """Loopback TCP between the CLI and the adapter that cuts one response: the first stream to carry a
    ``response.output_item.done`` is closed right after that event (and its HTTP chunk's end), as a dropped
    connection would be, before the turn's later items and ``response.completed``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.cuts = 0
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task] = set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for connection in self.connections:
            connection.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections.add(asyncio.current_task())  # type: ignore[arg-type]
        upstream_r, upstream_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        ask = asyncio.create_task(self._copy(client_r, upstream_w))
        try:
            await self._answer(upstream_r, client_w)
        finally:
            ask.cancel()
            client_w.close()
            upstream_w.close()

    @staticmethod
    async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The CLI's bytes to the adapter; the CLI's side closed, the adapter's is closed too."""
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    async def _answer(self, upstream: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        seen, sent = b"", 0
        while data := await upstream.read(65536):
            seen += data
            cut = None if self.cuts else self._cut_at(seen)
            end = max(sent, len(seen) if cut is None else cut)  # nothing past the cut ever reaches the CLI
            client.write(seen[sent:end])
            await client.drain()
            sent = end
            if cut is not None:
                self.cuts += 1
                return

    @staticmethod
    def _cut_at(seen: bytes) -> int | None:
        """Where the first whole output_item.done event (and its chunk's CRLF) ends, once it has arrived."""
        start = seen.find(ITEM_DONE)
        end = seen.find(b"\n\n", start) if start >= 0 else -1
        if end < 0 or len(seen) < end + 4:
            return None
        return end + 4 if seen[end + 2 : end + 4] == b"\r\n" else end + 2


async def test_shell_then_apply_patch_fix_lands_on_disk_and_every_sampled_token_trains(
    rig: Rig, tmp_path: Path, tokenizer
) -> None:
    rollout = await play_codex(rig, tmp_path, FIX)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr[-3000:]
    events = stream_events(rollout.completed.stdout)
    kinds = [e["item"]["type"] for e in events if e.get("type") == "item.completed"]
    assert kinds == ["command_execution", "file_change", "agent_message"]
    assert events[-1]["type"] == "turn.completed"
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()
    assert "+    " + FIXED_LINE in git_diff(rollout.workdir)
    assert decoded_outputs(rollout, tokenizer) == [t + IM_END for t in script_turns(RIG_SCRIPT)]
    assert {t["chain_id"] for t in rollout.turns} == {"main"}
    # Codex resent its whole history each time: every turn stitched onto the one before it
    assert [t["prompt_ref_turn"] for t in rollout.turns] == [None, 0, 1]
    resolved = rollout.resolved()
    assert "def sum_to" in tokenizer.decode(resolved[1].prompt_ids[-300:])  # the shell's output came back
    assert "Success. Updated the following files" in tokenizer.decode(resolved[2].prompt_ids[-200:])
    assert_trains_every_sampled_token(rollout, ["final"])
    assert session_kinds(rollout, "main") == [("opened", "first"), ("closed", "rollout_end")]


async def test_another_rollouts_closed_token_is_a_401_each_time_codex_asks(rig: Rig, tmp_path: Path) -> None:
    """A token whose rollout was closed (what an agent that kept an earlier rollout's token would send) gets
    a 401 on /v1/responses each time: Codex's stream retries repeat the request (``STREAM_RETRIES`` times),
    then it fails the run, and nothing reaches the bus."""
    other = f"e2e-{uuid.uuid4().hex[:10]}"
    stale = await rig.open_session(other, "codex")
    await rig.close_session_if_open(other)
    before = await rig.answered(401, route="/v1/responses")
    rollout = await play_codex(rig, tmp_path, FIX, token=stale)

    assert rollout.completed.exit_code != 0
    assert "401" in rollout.completed.stdout + rollout.completed.stderr
    assert await rig.answered(401, route="/v1/responses") - before == 1 + codex_cli.STREAM_RETRIES
    assert rollout.turns == [] and git_diff(rollout.workdir) == ""
    assert await rollout_events(rig.bootstrap, rig.namespace, "turns", other) == []


async def test_its_tools_get_no_token_in_their_environment_nor_from_the_clis_process(
    rig: Rig, tmp_path: Path
) -> None:
    """The attacker's move: a shell command that dumps its own environment and every process's environ and
    command line in the sandbox into the workspace. Its own environment holds no token (Codex hands its tools
    only its core variables and ours; by default it hands them everything), and the CLI's /proc/<pid>/environ
    is closed to it (an execute-only binary: the kernel makes the process non-dumpable). The sandbox's pid 1
    (bwrap, readable by the tools) never had it: the token reaches Codex through a pipe read before the CLI
    starts (tests/test_sandbox_secrets.py); before, a tool read it from /proc/1/environ. (Claude Code hands
    its whole environment to its tools, token included: there only the adapter proxy's peer stamp keeps a
    tool's request from training, tests/test_sandbox_attribution.py.)"""
    rig.use_script(SCRIPTS / "runner" / "codex_token_probe.json")
    rollout_id = f"e2e-{uuid.uuid4().hex[:10]}"
    token = await rig.open_session(rollout_id, "codex")
    rollout = await play_codex(rig, tmp_path, FIX, token=token, rollout_id=rollout_id)
    await rig.close_session_if_open(rollout_id)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr[-3000:]
    own_env, *processes = (rollout.workdir / "leak.txt").read_text().split("== /proc/")
    assert "PYTHONDONTWRITEBYTECODE=1" in own_env and "PATH=" in own_env
    assert token not in own_env and "ROLLBUS_CODEX_TOKEN" not in own_env
    headers = [p.split("\n", 1)[0].split(" ", 1) for p in processes]  # pid, command line
    (cli,) = [
        p for p, (_, argv) in zip(processes, headers, strict=True) if argv.startswith("/opt/codex/codex exec")
    ]
    assert token not in cli and "Permission denied" in cli
    (init,) = [p for p, (pid, _) in zip(processes, headers, strict=True) if pid == "1"]
    assert "bwrap" in init and "PATH=" in init  # bwrap's environment was read...
    assert token not in "".join(processes)  # ...and no process it could read held the token


# --- codex_compact.json: Codex's local compaction ---------------------------------------------------

COMPACT_SCRIPT = SCRIPTS / "runner" / "codex_compact.json"
# Codex compacts before its next request once the last response's usage plus its estimate of the items added
# since reaches the limit: ~2.8k prompt tokens + the `seq 1 2000` output (~2.2k by its estimate) is over it,
# the rewritten ~2.9k-token prompt and the patch after it are under it (so it compacts once). Sub-agent tools
# are off here: their ~1.2k tokens in every prompt would move both sides of that margin. These settings come
# after the runner's own (a later `-c` wins), so they also replace its compact_limit.
AUTO_COMPACT = ("-c", "model_auto_compact_token_limit=3800", "-c", "agents.enabled=false")
CHECKPOINT = "You are performing a CONTEXT CHECKPOINT COMPACTION"
HANDOFF = "Another language model started to solve this problem"


async def test_compaction_is_a_chain_of_its_own_and_the_rewritten_history_a_new_one(
    rig: Rig, tmp_path: Path, tokenizer
) -> None:
    """Codex's local compaction: a tool-less request (the history so far + a checkpoint message) whose reply
    is the summary, then a history rewritten to the opening messages + the summary as a user message. The
    summary call is a chain of its own (as Claude Code's summary request is), the rewritten history another;
    the two earlier chains are frozen as wipes, every sampled token trains, and the summary trains only
    where it was sampled."""
    rig.use_script(COMPACT_SCRIPT)
    rollout = await play_codex(rig, tmp_path, FIX, extra_args=AUTO_COMPACT)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr[-3000:]
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()  # by apply_patch, after the compaction
    assert "+    " + FIXED_LINE in git_diff(rollout.workdir)
    assert decoded_outputs(rollout, tokenizer) == [t + IM_END for t in script_turns(COMPACT_SCRIPT)]
    assert [t["chain_id"] for t in rollout.turns] == ["main", "main.1", "main.2", "main.2"]
    listing, checkpoint, rewritten, last = rollout.resolved()
    compaction = tokenizer.decode(checkpoint.prompt_ids)
    assert CHECKPOINT in compaction and "\n1999\n2000\n" in compaction  # the whole history, then the request
    assert "<tools>" in tokenizer.decode(listing.prompt_ids) and "<tools>" not in compaction  # offered none
    summary = script_turns(COMPACT_SCRIPT)[1].split("</think>\n\n")[1]
    opening = tokenizer.decode(rewritten.prompt_ids)
    assert HANDOFF in opening and summary in opening  # the summary's text came back as a user message
    assert "seq 1 2000" not in opening and CHECKPOINT not in opening  # the rest of the history is gone
    assert "The context is full" not in opening  # the summary call's reasoning is not handed over
    assert [t["prompt_ref_turn"] for t in rollout.turns] == [None, None, None, 0]
    assert "Success. Updated the following files" in tokenizer.decode(last.prompt_ids[-200:])
    # no tools, then tools again: each restart is a `tools_changed` rewrite of main's history
    assert session_kinds(rollout, "main") == [("opened", "first"), ("frozen", "tools_changed")]
    assert session_kinds(rollout, "main.1") == [("opened", "tools_changed"), ("frozen", "tools_changed")]
    assert session_kinds(rollout, "main.2") == [("opened", "tools_changed"), ("closed", "rollout_end")]
    assert_trains_every_sampled_token(rollout, ["wipe", "wipe", "final"])


async def test_a_stream_cut_after_its_first_item_is_retried_and_answered_with_the_rest_of_that_turn(
    rig: Rig, tmp_path: Path, tokenizer
) -> None:
    """The first response is cut after its reasoning item, before its exec_command call and completion.
    Codex retries with that item appended to the same history; the adapter answers with the rest of the turn
    it recorded (no new sample), so the run goes on as if nothing happened: three turns, each trained once,
    one chain. Without stream retries the cut fails the run; answered with a new sample instead, the
    retry's turn (the script's next one) and a rewritten chain would show on the bus."""
    rig.use_script(RIG_SCRIPT)  # the module's script again (a test before may have served another)
    retried = await rig.metric("rollbus_adapter_stream_retries_total")
    answered = await rig.answered(200, route="/v1/responses")
    proxy = CuttingProxy(rig.adapter_port)
    async with proxy as url:
        rollout = await play_codex(rig, tmp_path, FIX, url=url)

    assert proxy.cuts == 1
    assert rollout.completed.exit_code == 0, rollout.completed.stderr[-3000:]
    events = stream_events(rollout.completed.stdout)
    assert [e["message"][:16] for e in events if e["type"] == "error"] == ["Reconnecting... "]  # one retry
    assert events[-1]["type"] == "turn.completed"
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()
    assert await rig.metric("rollbus_adapter_stream_retries_total") - retried == 1
    assert await rig.answered(200, route="/v1/responses") - answered == 4  # three turns and the retry
    assert decoded_outputs(rollout, tokenizer) == [t + IM_END for t in script_turns(RIG_SCRIPT)]
    assert [t["chain_id"] for t in rollout.turns] == ["main"] * 3
    assert [t["prompt_ref_turn"] for t in rollout.turns] == [None, 0, 1]  # each stitched onto the one before
    assert_trains_every_sampled_token(rollout, ["final"])
    assert session_kinds(rollout, "main") == [("opened", "first"), ("closed", "rollout_end")]
