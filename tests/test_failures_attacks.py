"""The policy must not escape its zero by crashing the machinery: attacks on the failure taxonomy, written as
the policy would try them, through the real runner attempt (a real bwrap sandbox under its limits), the
grader's reward, the segmenter's state machine and the trainer's batch."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollbus import codec
from rollbus.failures import INFRASTRUCTURE, POLICY
from rollbus.grading import GradeConfig
from rollbus.sandbox import Completed, bwrap_usable
from rollbus.services.grader.core import grade_diff, reward_record
from rollbus.services.sandbox_runner import harnesses, rollout
from rollbus.services.sandbox_runner.harnesses import Exit, Launch, Where
from rollbus.services.sandbox_runner.outcome import diff_event
from rollbus.services.sandbox_runner.settings import RunnerSettings
from rollbus.services.segmenter.segmentation import Segmenter
from rollbus.services.segmenter.segmentation.state import FACT_KINDS, Fact
from rollbus.trainer.batch import GroupBuffer, segment_inputs
from rollbus.trainer.batch import infrastructure_failed as is_marker
from tests.synthetic_rollouts import RolloutWriter

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_REPO = ROOT / "examples" / "buggy_repo"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
TOPIC_EVENT = {"turns": "turn", "sessions": "session", "diffs": "diff", "rewards": "reward"}
needs_root_bwrap = pytest.mark.skipif(
    not bwrap_usable() or os.geteuid() != 0, reason="needs bubblewrap and root (cgroups, tmpfs mounts)"
)


class Sessions:
    """The adapter's sessions API as the runner sees it (the attack is on the sandbox, not the adapter)."""

    async def open(self, rollout_id: str, attempt_id: str, harness: str = "") -> str:
        return "token"

    async def close(self, rollout_id: str, attempt_id: str | None, deadline: float | None = None) -> None:
        return None


def task(rollout_id: str) -> dict[str, Any]:
    metadata = {"image": str(EXAMPLE_REPO), "workdir": "/workspace", "eval_cmd": "python3 -m unittest -q"}
    return {"rollout_id": rollout_id, "group_id": "g", "group_size": 2, "sample_index": 1,
            "metadata": codec_json(metadata), "label": None}  # fmt: skip


def codec_json(value: Any) -> str:
    return json.dumps(value)


@dataclass
class ShellHarness:
    """A harness whose agent is a shell command (the attacker's), run as the runner runs any harness's CLI."""

    command: str | None  # None: no agent may run
    name = "shell"
    adapter_harness = "claude_code"
    installs_in_vm = False

    def host_files(self, settings: RunnerSettings) -> dict[str, str]:
        return {"/bin/true": "/opt/shell/true"}

    def launch(
        self, settings: RunnerSettings, where: Where, prompt: str, token: str, timeout: float
    ) -> Launch:
        if self.command is None:
            raise AssertionError("no agent may run when the sandbox never booted")
        return Launch(["sh", "-c", self.command], dict(ENV))

    def read_exit(self, completed: Completed) -> Exit:
        return harnesses.stream_json_exit(completed)

    async def install_in_vm(self, kit: Any, sandbox: Any) -> str:
        raise NotImplementedError


def use_harness(monkeypatch: pytest.MonkeyPatch, harness: ShellHarness, *, breaks: bool = False) -> None:
    """Every attempt runs ``harness``; with ``breaks`` its agent takes its sandbox down with it, so the runner
    finds it gone when it comes for the patch."""
    monkeypatch.setattr(rollout.harnesses, "harness", lambda name: harness)
    made = rollout.create_sandbox

    async def create(*args: Any, **kwargs: Any) -> Any:
        sandbox = await made(*args, **kwargs)
        run = sandbox.run

        async def run_then_break(*a: Any, agent: bool = False, **kw: Any) -> Completed:
            done = await run(*a, agent=agent, **kw)
            if agent and breaks:
                await sandbox.close()
            return done

        sandbox.run = run_then_break  # type: ignore[method-assign]
        return sandbox

    monkeypatch.setattr(rollout, "create_sandbox", create)


async def attempt_with_agent(monkeypatch: pytest.MonkeyPatch, agent: str, *, breaks: bool) -> Any:
    """One real runner attempt (``rollout.run_task``: a bwrap sandbox of the task's image under 64 pids, its
    patch taken by git inside it) whose agent is the shell command ``agent``."""
    use_harness(monkeypatch, ShellHarness(agent), breaks=breaks)
    settings = RunnerSettings(pids=64, memory_mb=256, boot_attempts=1, agent_timeout=60)
    kit = rollout.RunnerKit(settings, Sessions())  # type: ignore[arg-type]
    return await rollout.run_task(kit, task("attacker-1"))


async def rewarded(outcome: Any) -> dict[str, Any]:
    """The grader's reward for the attempt's diff (a failed rollout is never graded, whatever its patch)."""
    diff = diff_event(task("attacker-1"), outcome)
    result = await grade_diff(diff, ROOT, GradeConfig())
    return reward_record(diff, result).to_dict()


def segments_of(reward: dict[str, Any]) -> list[dict[str, Any]]:
    """What the real segmenter cuts for the attacker's rollout: its main chain's turns, then the reward."""
    writer = RolloutWriter("attacker-1", attempt_id=reward["attempt_id"], group_id="g")
    writer.turn("main", "main", [1, 2, 3], 4)
    writer.turn("main", "main", [5], 3)
    writer.close()
    segmenter, out = Segmenter({}, {}), []
    for topic, record in [*writer.events, ("rewards", reward)]:
        raw = codec.encode(TOPIC_EVENT[topic], record)
        handled = segmenter.handle(Fact(FACT_KINDS[topic], codec.decode(raw).record, 0), raw)
        out += [codec.decode(m).record for m in handled.messages]
        segmenter.settle(handled)
    return out


@needs_root_bwrap
async def test_an_agent_that_exhausts_and_breaks_its_sandbox_is_a_trained_zero(monkeypatch) -> None:
    """The agent edits a file, fork-bombs its sandbox into its pids limit and takes the sandbox down, so the
    runner's capture fails: where a crashed runner would be the infrastructure's, this is ``sandbox_broken``,
    policy, reward 0; its segments train with the group's baseline below it."""
    bomb = "echo '# mine' >> calc.py; i=0; while [ $i -lt 200 ]; do sleep 30 & i=$((i+1)); done; wait"
    outcome = await attempt_with_agent(monkeypatch, bomb, breaks=True)
    assert outcome.failure_kind == "sandbox_broken", outcome
    reward = await rewarded(outcome)
    assert (reward["reward"], reward["failure_class"]) == (0.0, POLICY)
    assert reward["failure_cause"] == "sandbox_broken"
    assert reward["rerun_rollout_id"] is None
    segments = segments_of(reward)
    assert segments and not any(is_marker(s) for s in segments)
    assert {s["failure_class"] for s in segments} == {POLICY}
    buffer = GroupBuffer(group_size=2)
    honest = {**segments[-1], "rollout_id": "honest", "segment_id": "honest/0", "index": 0,
              "num_segments": 1, "trajectory_reward": 1.0, "reward": 1.0, "failure_class": None,
              "failure_cause": None}  # fmt: skip
    for s in [*segments, honest]:
        buffer.add(s)
    (group,) = buffer.take(1)
    inputs = segment_inputs([group], normalize_std=False)
    assert len(inputs) == len(segments) + 1  # every one of the attacker's segments trains ...
    assert [x.advantage for x in inputs[: len(segments)]] == [-0.5] * len(segments)  # ... as the group's 0


@needs_root_bwrap
async def test_an_agent_that_only_exhausts_its_limits_is_named_by_the_limit_and_is_the_policys(monkeypatch):
    outcome = await attempt_with_agent(monkeypatch, "while :; do sleep 30 & done", breaks=False)
    assert outcome.failure_kind == "pids_limit", outcome
    reward = await rewarded(outcome)
    assert (reward["reward"], reward["failure_class"], reward["failure_cause"]) == (0.0, POLICY, "pids_limit")


@needs_root_bwrap
async def test_a_sandbox_that_cannot_boot_is_the_infrastructures(monkeypatch) -> None:
    """The control: the same attempt with an image that does not exist fails before any agent runs."""

    use_harness(monkeypatch, ShellHarness(None))
    kit = rollout.RunnerKit(RunnerSettings(boot_attempts=1), Sessions())  # type: ignore[arg-type]
    bad = {**task("attacker-1"), "metadata": codec_json({"image": "/nonexistent/image", "workdir": "/w"})}
    outcome = await rollout.run_task(kit, bad)
    assert outcome.failure_kind == "boot_failed", outcome
    diff = diff_event(bad, outcome)
    reward = reward_record(diff, await grade_diff(diff, ROOT, GradeConfig(), grade_failed_rollouts=True))
    assert (reward.failure_class, reward.failure_cause) == (INFRASTRUCTURE, "boot_failed")
