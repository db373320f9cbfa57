"""The real Claude Code CLI, in bwrap, against the real adapter and the scripted engine, onto a real broker.

One adapter serves the whole session (the conftest's ``session_rig``, publishing to a topic namespace of
its own); the engine is restarted only when the script changes, so the tests are grouped by script. Each
test is its own rollout (its own session token), reads its events back from the bus by rollout id and checks
what training would see: the sampled tokens, the prompts they resolve to, the segments and their loss masks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollbus.sandbox import git_diff
from tests.e2e_support import SCRIPTS, Rig, Rollout, new_rollout_id, play, script_turns

pytestmark = pytest.mark.kafka

FIX = "The tests in /workspace fail. Fix the bug."
IM_END = "<|im_end|>"
FIXED_LINE = "return sum(range(1, n + 1))"
FIX_CALC = SCRIPTS / "fix_calc.json"


@pytest.fixture
async def fix_calc(rig: Rig) -> AsyncIterator[Rig]:
    rig.use_script(FIX_CALC)
    yield rig


def assert_trains_every_sampled_token(rollout: Rollout, kinds: list[str]) -> None:
    """Segments come in ``kinds`` order; every sampled token (side chains aside) is trained with the
    logprob the engine reported for it, and nothing else is."""
    segments = rollout.segments(1.0)
    assert [s.kind for s in segments] == kinds
    trained = [t for t in rollout.turns if t["chain_kind"] != "side"]
    assert sum(sum(s.loss_mask) for s in segments) == sum(len(t["output_ids"]) for t in trained)
    for segment in segments:
        chain = [t for t in trained if t["chain_id"] == segment.chain_id]
        sampled = [lp for t in chain for lp in t["output_logprobs"]]
        masked = [lp for lp, m in zip(segment.rollout_logprobs, segment.loss_mask, strict=True) if m]
        assert masked == sampled
        ids = [i for i, m in zip(segment.response_ids, segment.loss_mask, strict=True) if m]
        assert ids == [i for t in chain for i in t["output_ids"]]
    assert all(s.reward == pytest.approx(1.0 / len(segments)) for s in segments)


def session_kinds(rollout: Rollout, chain_id: str) -> list[tuple[str, str | None]]:
    return [(s["kind"], s["reason"]) for s in rollout.sessions if s["chain_id"] == chain_id]


def decoded_outputs(rollout: Rollout, tokenizer: Any, chain_kind: str = "main") -> list[str]:
    turns = [t for t in rollout.turns if t["chain_kind"] == chain_kind]
    return [tokenizer.decode(t["output_ids"], skip_special_tokens=False) for t in turns]


# --- fix_calc.json: read, edit, finish; a max_tokens stop; an unknown session token -----------------


async def test_read_edit_finish_lands_on_disk_and_on_the_bus(
    fix_calc: Rig, tmp_path: Path, tokenizer
) -> None:
    rollout = await play(fix_calc, tmp_path, FIX)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr
    assert rollout.result["subtype"] == "success" and rollout.result["num_turns"] == 3
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()
    assert "+    " + FIXED_LINE in git_diff(rollout.workdir)
    assert {t["chain_id"] for t in rollout.turns} == {"main"}
    assert decoded_outputs(rollout, tokenizer) == [t + IM_END for t in script_turns(FIX_CALC)]
    assert [t["finish_reason"] for t in rollout.turns] == ["stop"] * 3
    resolved = rollout.resolved()
    assert [len(t.prompt_ids) for t in resolved] == [t["prompt_tokens"] for t in rollout.turns]
    assert [t["prompt_ref_turn"] for t in rollout.turns] == [None, 0, 1]
    assert "def sum_to" in tokenizer.decode(resolved[1].prompt_ids[-300:])  # the Read result came back
    assert_trains_every_sampled_token(rollout, ["final"])
    assert session_kinds(rollout, "main") == [("opened", "first"), ("closed", "rollout_end")]


async def test_max_tokens_stop_is_continued_and_its_tokens_still_train(
    fix_calc: Rig, tmp_path: Path, tokenizer
) -> None:
    """The Edit turn is cut at the CLI's 64-token cap: stop_reason max_tokens, the CLI asks
    the model to resume, and the cut turn's sampled tokens stay in the trajectory with mask 1."""
    cap = 64
    complete = [len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in script_turns(FIX_CALC)]
    assert complete[0] < cap < complete[1] and complete[2] < cap  # only the Edit turn is too long
    rollout = await play(fix_calc, tmp_path, FIX, max_output_tokens=cap)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr
    assert rollout.result["subtype"] == "success"
    finishes = [(t["finish_reason"], len(t["output_ids"])) for t in rollout.turns]
    assert finishes == [("stop", complete[0]), ("length", cap), ("stop", complete[2])]
    cut = decoded_outputs(rollout, tokenizer)[1]
    assert script_turns(FIX_CALC)[1].startswith(cut) and IM_END not in cut
    resumed = rollout.resolved()[2]
    assert rollout.turns[2]["prompt_ref_turn"] == 1  # the cut turn stays in the chain's stream
    assert "Output token limit hit" in tokenizer.decode(resumed.prompt_ids[-80:])
    assert git_diff(rollout.workdir) == ""  # the Edit call was cut before it was complete
    assert_trains_every_sampled_token(rollout, ["final"])


async def test_unknown_session_token_fails_fast_without_retries(fix_calc: Rig, tmp_path: Path) -> None:
    before = await fix_calc.answered(401)
    rollout = await play(fix_calc, tmp_path, FIX, token="rb-not-a-session-token")

    assert rollout.completed.exit_code != 0
    assert rollout.result["is_error"] and "unknown session token" in rollout.result["result"]
    assert not [e for e in rollout.events if e.get("subtype") == "api_retry"]
    assert await fix_calc.answered(401) - before == 1  # x-should-retry: false is obeyed
    assert rollout.turns == [] and git_diff(rollout.workdir) == ""


# --- subagent_fix.json: an Agent dispatch ------------------------------------------------------------


async def test_subagent_dispatch_is_its_own_chain_and_segment(rig: Rig, tmp_path: Path, tokenizer) -> None:
    rig.use_script(SCRIPTS / "subagent_fix.json")
    rollout = await play(rig, tmp_path, FIX)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()
    subagent_chains = {t["chain_id"] for t in rollout.turns if t["chain_kind"] == "subagent"}
    assert len(subagent_chains) == 1
    (subagent,) = subagent_chains
    script = SCRIPTS / "subagent_fix.json"
    assert decoded_outputs(rollout, tokenizer, "subagent") == [
        t + IM_END for t in script_turns(script, "subagent_turns")
    ]
    assert decoded_outputs(rollout, tokenizer) == [t + IM_END for t in script_turns(script)]
    handed_back = rollout.resolved()[-2]  # the main turn after the Agent call sees the sub-agent's answer
    assert "leaves out `n` itself" in tokenizer.decode(handed_back.prompt_ids[-200:])
    assert session_kinds(rollout, subagent) == [("opened", "first"), ("frozen", "subagent")]
    assert [s["parent_chain_id"] for s in rollout.sessions if s["chain_id"] == subagent] == ["main"] * 2
    assert_trains_every_sampled_token(rollout, ["subagent", "final"])
    assert [s.reward for s in rollout.segments(1.0)] == [0.5, 0.5]


# --- compact_fix.json: a proactive compaction ----------------------------------------------------------


# threshold = floor((window - min(max output, 20000)) * pct / 100) = floor(91808 * 0.30) = 27542 tokens:
# above the ~19k prompt before the 2000-line `seq` result, below the ~29k prompt after it.
AUTO_COMPACT = {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": "100000", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "30"}


async def test_compaction_freezes_the_chain_and_the_episode_goes_on(
    rig: Rig, tmp_path: Path, tokenizer
) -> None:
    rig.use_script(SCRIPTS / "compact_fix.json")
    rollout = await play(rig, tmp_path, FIX, env=AUTO_COMPACT)

    assert rollout.completed.exit_code == 0, rollout.completed.stderr
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()  # by sed, after the compaction
    chains = list(dict.fromkeys(t["chain_id"] for t in rollout.turns))
    assert chains == ["main", "main.1", "main.2"]
    assert {t["chain_kind"] for t in rollout.turns} == {"main"}
    summary_prompt = tokenizer.decode(rollout.resolved()[3].prompt_ids[-2000:])
    assert "<summary>" in summary_prompt  # main.1 is the CLI's summary request
    continued = tokenizer.decode(rollout.resolved()[4].prompt_ids)
    assert "continued from a previous conversation" in continued and "seq 1000 2999" not in continued
    # the summary request branches off the conversation; the continued one rewrites its opening
    assert session_kinds(rollout, "main")[-1] == ("frozen", "fork")
    assert session_kinds(rollout, "main.1") == [("opened", "fork"), ("frozen", "compaction")]
    assert session_kinds(rollout, "main.2") == [("opened", "compaction"), ("closed", "rollout_end")]
    assert_trains_every_sampled_token(rollout, ["wipe", "wipe", "final"])


# --- wait_then_fix.json: the engine goes away mid-session and comes back --------------------------------


async def wait_for(check, what: str, timeout: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def test_engine_outage_is_retried_until_the_engine_is_back(rig: Rig, tmp_path: Path) -> None:
    """Turn 0 is a Bash call that blocks until ``/workspace/.resume`` exists: the engine is stopped while
    it blocks, so the next turn fails (500, retryable) until the engine is started again."""
    script = SCRIPTS / "wait_then_fix.json"
    rig.use_script(script)
    tool_turns = await rig.metric("rollbus_adapter_turns_total", chain_kind="main", stop_reason="tool_use")
    failures = await rig.answered(500)
    rollout_id = new_rollout_id()
    blocking = {"CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1"}  # else the CLI backgrounds the waiting Bash
    episode = asyncio.create_task(play(rig, tmp_path, FIX, rollout_id=rollout_id, env=blocking))
    try:
        await wait_for(lambda: _tool_turns_grew(rig, tool_turns), "turn 0")
        await asyncio.to_thread(rig.stop_engine)
        (tmp_path / rollout_id / ".resume").touch()
        await wait_for(lambda: _failed_again(rig, failures), "a failed attempt")
        await asyncio.to_thread(rig.start_engine, script)  # a fresh cursor: Bash again, then the fix
        rollout = await episode
    finally:
        episode.cancel()

    assert rollout.completed.exit_code == 0, rollout.completed.stderr
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()
    retries = [e for e in rollout.events if e.get("subtype") == "api_retry"]
    assert len(retries) >= 2 and {e["error_status"] for e in retries} == {500}
    assert [r["attempt"] for r in retries] == list(range(1, len(retries) + 1))
    # every failed attempt is a 500, except that a streaming request may fail inside its 200 stream
    assert len(retries) - 1 <= await rig.answered(500) - failures <= len(retries)
    assert {t["chain_id"] for t in rollout.turns} == {"main"}  # failed attempts left no trace
    assert len(rollout.turns) == 5
    assert_trains_every_sampled_token(rollout, ["final"])


async def _tool_turns_grew(rig: Rig, before: float) -> bool:
    return await rig.metric("rollbus_adapter_turns_total", chain_kind="main", stop_reason="tool_use") > before


async def _failed_again(rig: Rig, before: int) -> bool:
    """At least one 500 (the first failure may instead be an error event inside a 200 stream)."""
    return await rig.answered(500) - before >= 1


async def test_a_killed_adapter_restarts_and_the_cli_finishes_the_episode(rig: Rig, tmp_path: Path) -> None:
    """``kill -9`` while the agent's Bash call blocks: the CLI's next request is refused until the adapter
    is back; the new process rebuilds the rollout from the bus and continues the same chain."""
    script = SCRIPTS / "wait_then_fix.json"
    rig.use_script(script)
    tool_turns = await rig.metric("rollbus_adapter_turns_total", chain_kind="main", stop_reason="tool_use")
    rollout_id = new_rollout_id()
    blocking = {"CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1"}
    episode = asyncio.create_task(play(rig, tmp_path, FIX, rollout_id=rollout_id, env=blocking))
    try:
        await wait_for(lambda: _tool_turns_grew(rig, tool_turns), "turn 0")
        await asyncio.to_thread(rig.kill_adapter)
        (tmp_path / rollout_id / ".resume").touch()  # the CLI asks for turn 1 while nothing listens
        await asyncio.sleep(1.0)
        await asyncio.to_thread(rig.ensure_adapter)  # its start may take minutes on a loaded box
        rollout = await episode
    finally:
        episode.cancel()

    assert rollout.completed.exit_code == 0, rollout.completed.stderr
    assert FIXED_LINE in (rollout.workdir / "calc.py").read_text()
    assert [e for e in rollout.events if e.get("subtype") == "api_retry"]  # it did need its retries
    assert [(t["chain_id"], t["turn_index"]) for t in rollout.turns] == [("main", i) for i in range(4)]
    assert session_kinds(rollout, "main") == [("opened", "first"), ("closed", "rollout_end")]
    assert_trains_every_sampled_token(rollout, ["final"])
