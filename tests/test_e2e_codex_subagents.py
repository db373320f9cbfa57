"""The real Codex CLI's sub-agents, in bwrap, against the real adapter and the scripted engine, onto a real
broker: a child thread's requests are a ``subagent`` chain of the same rollout, the parent's chain goes on
when the child's report comes back, and every sampled token of both trains.

The script (``runner/codex_subagent.json``): the parent spawns one sub-agent, waits for it (the engine fills
in the id Codex returned), fixes calc.py with apply_patch and answers; the sub-agent reads calc.py with the
shell and reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollbus.services.adapter.provenance import TurnRef, tool_use_id
from tests.e2e_support import SCRIPTS, Rig, play_codex, stream_events
from tests.test_e2e_claude_code import assert_trains_every_sampled_token, decoded_outputs, session_kinds

pytestmark = pytest.mark.kafka

ASK = "The tests in this directory fail. Have a sub-agent read calc.py, then fix the bug."
FIXED_LINE = "return sum(range(1, n + 1))"
IM_END = "<|im_end|>"
RIG_SCRIPT = SCRIPTS / "runner" / "codex_subagent.json"  # the conftest rig replays it


async def test_a_spawned_sub_agent_is_a_subagent_chain_and_every_sampled_token_trains(
    rig: Rig, tmp_path: Path, tokenizer
) -> None:
    rollout = await play_codex(rig, tmp_path, ASK)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr[-3000:]
    events = stream_events(rollout.completed.stdout)
    calls = [e["item"] for e in events if e.get("type") == "item.completed"]
    assert [c["type"] for c in calls] == [
        "collab_tool_call",
        "collab_tool_call",
        "file_change",
        "agent_message",
    ]
    spawn, wait = calls[:2]
    (thread,) = spawn["receiver_thread_ids"]
    assert spawn["status"] == wait["status"] == "completed"
    assert wait["agents_states"][thread]["status"] == "completed"
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()

    # the child's thread is a chain of its own, named by its thread id, claimed by the parent's spawn call
    child = f"agent-{thread}"
    assert {(t["chain_id"], t["chain_kind"]) for t in rollout.turns} == {
        ("main", "main"),
        (child, "subagent"),
    }
    script = json.loads(RIG_SCRIPT.read_text())
    assert decoded_outputs(rollout, tokenizer, "subagent") == [t + IM_END for t in script["subagent_turns"]]
    main = [t if isinstance(t, str) else t["text"].replace("{agent}", thread) for t in script["turns"]]
    assert decoded_outputs(rollout, tokenizer) == [t + IM_END for t in main]
    opened = next(s for s in rollout.sessions if s["chain_id"] == child and s["kind"] == "opened")
    spawn_call = tool_use_id(TurnRef(rollout.rollout_id, "main", 0), 0)  # main's first turn's one call
    assert opened["parent_tool_use_id"] == spawn_call
    assert opened["agent_id"] == thread and opened["parent_chain_id"] == "main"

    # the parent's chain went on through the spawn result, the wait result and the notification
    parent = [t for t in rollout.turns if t["chain_id"] == "main"]
    assert [t["prompt_ref_turn"] for t in parent] == [None, 0, 1, 2]
    last = [t for t in rollout.resolved() if t.chain_id == "main"][-1]
    assert f'<subagent_notification>\n{{"agent_path":"{thread}"' in tokenizer.decode(list(last.prompt_ids))
    assert session_kinds(rollout, "main") == [("opened", "first"), ("closed", "rollout_end")]
    # the child's chain ended when its report reached the parent
    assert session_kinds(rollout, child) == [("opened", "first"), ("frozen", "subagent")]
    assert_trains_every_sampled_token(rollout, ["subagent", "final"])
