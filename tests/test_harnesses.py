"""The harness registry and each harness's launch and exit reading, as plain data (no sandbox).

The structural point: whatever the harness, its session token leaves the runner only as a secret (a pipe on
local sandboxes), never on its command line or in the environment the sandbox is configured with.
"""

from __future__ import annotations

import pytest

from rollbus.sandbox import Completed
from rollbus.services.sandbox_runner import harnesses
from rollbus.services.sandbox_runner.harnesses import Where, mini_swe_agent
from rollbus.services.sandbox_runner.settings import RunnerSettings

TOKEN = "rb1.secret-token-of-this-attempt"
WHERE = Where("http://127.0.0.1:8123", "/home/agent", "/workspace")


def done(stdout: str = "", exit_code: int = 0, timed_out: bool = False) -> Completed:
    return Completed(exit_code, stdout, "", 1.0, timed_out, "timeout" if timed_out else None)


def test_the_registry_names_each_harness_as_rows_and_the_runner_do() -> None:
    assert harnesses.AGENTS == ("claude_code", "codex", "mini_swe_agent")
    assert {name: h.name for name, h in harnesses.HARNESSES.items()} == {a: a for a in harnesses.AGENTS}
    assert RunnerSettings(agent="mini_swe_agent").agent == "mini_swe_agent"
    with pytest.raises(ValueError, match="mini_swe_agent"):
        RunnerSettings(agent="aider")
    with pytest.raises(harnesses.UnknownAgent, match="aider"):
        harnesses.harness("aider")


@pytest.mark.parametrize("name", ["claude_code", "codex", "mini_swe_agent"])
def test_the_token_is_a_secret_never_the_command_line_or_the_configured_environment(name: str) -> None:
    launch = harnesses.harness(name).launch(RunnerSettings(), WHERE, "Fix the bug.", TOKEN, 60.0)
    assert list(launch.secrets.values()) == [TOKEN]
    assert TOKEN not in " ".join(launch.cmd) and TOKEN not in " ".join(launch.env.values())
    assert "Fix the bug." in launch.cmd and launch.env["HOME"] == WHERE.home


def test_mini_swe_agent_asks_the_adapters_openai_chat_route_under_the_runners_limits() -> None:
    settings = RunnerSettings(model="m", max_turns=7, max_output_tokens=512)
    launch = mini_swe_agent.HARNESS.launch(settings, WHERE, "Fix the bug.", TOKEN, 90.0)
    python = f"{mini_swe_agent.INSIDE}/{mini_swe_agent.EXECUTE_ONLY}"
    assert launch.cmd[:3] == [python, "-m", "minisweagent.run.mini"]
    assert launch.cmd[launch.cmd.index("--model") + 1] == "openai/m"
    config = [launch.cmd[i + 1] for i, arg in enumerate(launch.cmd) if arg == "--config"]
    assert config[0] == "mini.yaml" and "agent.step_limit=7" in config and "agent.cost_limit=0" in config
    assert "agent.wall_time_limit_seconds=90" in config and "model.model_kwargs.max_tokens=512" in config
    assert launch.env["OPENAI_BASE_URL"] == "http://127.0.0.1:8123/v1" and "OPENAI_API_KEY" in launch.secrets
    assert harnesses.harness("mini_swe_agent").adapter_harness == "mini_swe_agent"


STEPS = "\nmini-swe-agent (step 1, $0.00):\nls\n\nUser:\n{}\n\nmini-swe-agent (step 2, $0.00):\necho\n"


@pytest.mark.parametrize(
    ("completed", "expected"),
    [
        (done(STEPS + "\nExit:\n\n"), (None, 2)),
        (done(STEPS + "\nExit:\nLimitsExceeded\n"), ("max_turns", 2)),
        (done(STEPS, exit_code=1), ("agent_crashed", 2)),
        (done(STEPS, exit_code=-9, timed_out=True), ("timeout", 2)),
        (done("Traceback (most recent call last):\n", exit_code=1), ("agent_crashed", 0)),
    ],
)
def test_mini_swe_agent_exit_is_read_from_what_mini_prints(completed: Completed, expected: tuple) -> None:
    exit_ = mini_swe_agent.HARNESS.read_exit(completed)
    assert (exit_.failure, exit_.turns) == expected


def test_a_harness_whose_cli_is_missing_is_install_failed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from rollbus.services.sandbox_runner.rollout import AttemptFailed, host_files

    monkeypatch.setenv("ROLLBUS_CACHE", str(tmp_path))
    with pytest.raises(AttemptFailed, match="mini_swe_agent fetch") as failed:
        host_files(mini_swe_agent.HARNESS, RunnerSettings())
    assert failed.value.kind == "install_failed"
