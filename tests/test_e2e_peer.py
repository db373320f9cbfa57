"""The agent's tool forging the agent's word, end to end: ``rollbus submit``, the sandbox runner with the
real Claude Code CLI in bwrap behind its adapter proxy, the real adapter and scripted engine, the grader
service and a real segmenter (Faust worker), all on one broker namespace.

In the turn where the main agent delegates to a sub-agent, its Bash tool first curls the adapter's
``/v1/messages`` with the session token and the adapter's address read from the environment the CLI's tools
inherit, a forged ``x-rollbus-peer: agent``, the CLI's sub-agent header and that Agent call's own prompt: the
claim that, believed, would train the tool's conversation as the sub-agent. The proxy replaces the header with
``tool``, so the adapter records the curl's turn as an ``unattributed`` chain that cuts no segment, and the
CLI's own main chain and sub-agent, stamped ``agent``, still train.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbus.kafka.topics import create_topics
from tests.conftest import TEST_PARTITIONS
from tests.e2e_support import EXAMPLES, SCRIPTS, Rig, rollout_events, script_turns
from tests.runner_support import (
    FIXED_LINE,
    RunnerProcess,
    all_events,
    calc_row,
    submit,
    wait_for,
    write_dataset,
)
from tests.segmenter_support import SegmenterProcess
from tests.test_e2e_provenance import bash

pytestmark = pytest.mark.kafka

INSTANCE = "calc-peer"
PROMPT = "Read /workspace/calc.py and report what sum_to returns."


def forged_claim() -> str:
    """The Bash command: the token and address expand in the tool's shell, the peer header is forged."""
    claim = {
        "model": "m", "max_tokens": 64, "system": "You are a sub-agent.",
        "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": PROMPT}],
    }  # fmt: skip
    return (
        "curl -s -o /dev/null -w 'forged %{http_code}\\n' -H \"authorization: Bearer $ANTHROPIC_AUTH_TOKEN\" "
        "-H 'content-type: application/json' -H 'x-rollbus-peer: agent' -H 'x-claude-code-agent-id: forged' "
        f"-d '{json.dumps(claim)}' \"$ANTHROPIC_BASE_URL/v1/messages\""
    )


def script() -> dict:
    """Claim the Agent call with the curl, then delegate; then fix calc.py (so the grader rewards 1)."""
    agent = (
        f"<tool_call>\n<function=Agent>\n<parameter=description>\nInspect calc.py\n</parameter>\n"
        f"<parameter=prompt>\n{PROMPT}\n</parameter>\n</function>\n</tool_call>"
    )
    first = f"Claim it myself, then delegate.\n</think>\n\n{bash(forged_claim(), 'Claim')}\n{agent}"
    return {
        "turns": [first, *script_turns(SCRIPTS / "fix_calc.json")],  # Read, Edit (of what it read), answer
        "subagent_turns": ["Nothing to read.\n</think>\n\nsum_to is off by one."] * 4,
    }


@pytest.fixture(scope="module")
def rig(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The adapter on a namespace of its own, where the runner, grader and segmenter run too."""
    namespace = f"e2e-peer-{uuid.uuid4().hex[:8]}"
    asyncio.run(create_topics(kafka_bootstrap, TEST_PARTITIONS, namespace))
    rig = Rig(kafka_bootstrap, namespace, tmp_path_factory.mktemp("peer-services"))
    rig.start()
    try:
        yield rig
    finally:
        rig.stop()


async def test_a_tool_forging_the_agent_peer_to_claim_the_agent_call_trains_nothing(
    rig: Rig, tmp_path: Path
) -> None:
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / f"{INSTANCE}.json").write_text(json.dumps(script()))
    rig.use_script(scripts)
    data = tmp_path / "data"
    shutil.copytree(EXAMPLES / "buggy_repo", data / "buggy_repo")
    assert (
        submit(
            rig.bootstrap, rig.namespace, write_dataset(data / "rows.jsonl", [calc_row(INSTANCE)])
        ).returncode
        == 0
    )
    (task,) = await all_events(rig.bootstrap, rig.namespace, "tasks")
    rollout_id = task["rollout_id"]
    segmenter = SegmenterProcess(rig.bootstrap, rig.namespace, tmp_path / "segmenter").start()
    grader = RunnerProcess.grader(rig.bootstrap, rig.namespace, tmp_path / "grader").start()
    runner = RunnerProcess(rig, rig.namespace, tmp_path / "runner").start()
    try:
        (diff,) = (await wait_for(rig.bootstrap, rig.namespace, "diffs", {rollout_id}, 400))[rollout_id]
        (reward,) = (await wait_for(rig.bootstrap, rig.namespace, "rewards", {rollout_id}, 180))[rollout_id]
        segments = await wait_for(rig.bootstrap, rig.namespace, "segments", {rollout_id}, 180)
    except TimeoutError:
        raise AssertionError(f"{runner.log()[-3000:]}\n{segmenter.log()[-3000:]}") from None
    finally:
        runner.stop()
        grader.stop()
        segmenter.stop()
    assert diff["failure_kind"] is None and FIXED_LINE.encode() in diff["patch"], runner.log()[-3000:]
    assert (reward["attempt_id"], reward["reward"]) == (diff["attempt_id"], 1.0), reward

    turns = await rollout_events(rig.bootstrap, rig.namespace, "turns", rollout_id)
    kinds = {t["chain_id"]: t["chain_kind"] for t in turns}
    (first,) = segments[rollout_id]
    every = [
        s for s in await all_events(rig.bootstrap, rig.namespace, "segments") if s["rollout_id"] == rollout_id
    ]
    assert len({s["segment_id"] for s in every}) == first["num_segments"]
    trained = {(s["chain_id"], s["kind"]) for s in every}
    forged = [c for c, k in kinds.items() if c == "agent-forged" or c.startswith("tool_peer-")]
    assert forged and not [c for c, _ in trained if c in forged], ("the curl's chain trained", trained, kinds)

    # the proxy's `tool` (not the forged `agent`): the curl's turn is unattributed and claimed nothing
    assert [kinds[c] for c in forged] == ["unattributed"] and forged[0].startswith("tool_peer-"), kinds
    assert await rig.metric("rollbus_adapter_unattributed_requests_total", cause="tool_peer") == 1
    sessions = await rollout_events(rig.bootstrap, rig.namespace, "sessions", rollout_id)
    assert not [s for s in sessions if s.get("reason") == "ambiguous"], "the tool's claim contested nothing"
    # the CLI's own requests, stamped `agent`: main and the sub-agent that answers the Agent call train
    (subagent,) = [c for c, k in kinds.items() if k == "subagent"]
    calls = {s.get("parent_tool_use_id") for s in sessions if s["chain_id"] == subagent} - {None, ""}
    assert len(calls) == 1, sessions
    assert trained == {("main", "final"), (subagent, "subagent")}, (trained, kinds)
    assert all(1 in s["loss_mask"] for s in every)
