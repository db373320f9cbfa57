"""The scripted engine answers each request in its harness's tools: the adapter names the harness whose route
a request came through (``X-Rollbus-Harness``), and a harness with scripts of its own (``--codex-script``)
gets those, so one engine serves a dataset whose rows run under Claude Code and Codex (``metadata.agent``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollbus.services.adapter.sglang_client import TurnHeaders
from rollbus.services.engine.main import EngineSettings, build_policy
from rollbus.services.engine.policies import ChainRoute, ScriptedPolicy, load_scripts, parse_script

SWE_MINI = Path(__file__).resolve().parents[1] / "examples" / "swe-mini"
HARNESSES = ("claude_code", "codex", "gym", "", "unknown")


def script(text: str):
    return parse_script({"turns": [text]})


def test_the_adapter_names_the_harness_and_the_engine_reads_it() -> None:
    headers = TurnHeaders("r-1", "main", "main", "codex").as_dict()
    assert ChainRoute.from_headers({k.lower(): v for k, v in headers.items()}) == ChainRoute(
        "r-1", "main", "main", "codex"
    )
    unnamed = TurnHeaders("r-1", "main", "main").as_dict()
    assert "X-Rollbus-Harness" not in unnamed  # nothing said: no header rather than an empty one
    assert ChainRoute.from_headers({k.lower(): v for k, v in unnamed.items()}).harness == ""


@pytest.mark.parametrize("harness", HARNESSES)
@pytest.mark.parametrize("rollout", ["task-ab12-0", "task-ab12-1", "task-ab12-2", "other-ab12-0"])
def test_a_harness_with_scripts_of_its_own_gets_them_and_every_other_gets_the_default_ones(harness, rollout):
    cc = {"task": script("cc"), "task@1": script("cc@1"), "default": script("cc-default")}
    codex = {"task": script("codex"), "task@1": script("codex@1"), "default": script("codex-default")}
    policy = ScriptedPolicy(cc["default"], by_prefix=cc, by_harness={"codex": codex})
    own = codex if harness == "codex" else cc
    expected = {
        "task-ab12-0": "task",
        "task-ab12-1": "task@1",
        "task-ab12-2": "task",
        "other-ab12-0": "default",
    }
    assert policy.script_for(rollout, harness) is own[expected[rollout]]
    assert (
        policy.scripted_turn(ChainRoute(rollout, "main", "main", harness)).text
        == own[expected[rollout]].turns[0].text
    )


def test_a_harness_whose_scripts_hold_no_default_gets_no_turns_for_other_rollouts() -> None:
    """Not the other harness's default: its tool calls would name tools this harness does not offer."""
    policy = ScriptedPolicy(script("cc"), by_harness={"codex": {"task": script("codex")}})
    final = policy.script_for("other-ab12-0", "codex")
    assert final.turns == () and policy.script_for("other-ab12-0", "claude_code").turns[0].text == "cc"


def test_one_script_file_serves_every_rollout_of_its_harness(tmp_path: Path) -> None:
    path = tmp_path / "codex.json"
    path.write_text(json.dumps({"turns": ["patch it"]}))
    codex = load_scripts(path)
    policy = ScriptedPolicy(script("cc"), by_harness={"codex": codex})
    assert policy.script_for("any-ab12-1", "codex").turns[0].text == "patch it"
    assert policy.script_for("any-ab12-1", "claude_code").turns[0].text == "cc"


def first_tool(text: str) -> str:
    found = re.search(r"<function=([^>\n]+)>", text)
    return found.group(1) if found else ""


@pytest.mark.parametrize(
    "task", sorted(p.stem for p in (SWE_MINI / "scripts-codex").glob("*.json") if "@" not in p.stem)
)
@pytest.mark.parametrize("sample", [0, 1])
def test_the_engine_the_stack_starts_answers_swe_mini_in_each_harness_s_tools(task: str, sample: int) -> None:
    """``rollbus up``'s engine flags: a Codex request of any swe-mini task calls Codex's tools, a Claude Code
    (or unnamed) request Claude Code's, sample 1 of the tasks with a failing variant included."""
    settings = EngineSettings(
        policy="scripted", script=SWE_MINI / "scripts", codex_script=SWE_MINI / "scripts-codex"
    )
    policy = build_policy(settings)
    rollout = f"{task}-ab12cd34ef-{sample}"
    codex = {first_tool(t.text) for t in policy.script_for(rollout, "codex").turns} - {""}
    claude = {first_tool(t.text) for t in policy.script_for(rollout, "claude_code").turns} - {""}
    unnamed = {first_tool(t.text) for t in policy.script_for(rollout, "").turns} - {""}
    assert codex and codex <= {"exec_command", "apply_patch"}, codex
    assert claude and claude <= {"Read", "Edit", "Bash"} and unnamed == claude, claude
