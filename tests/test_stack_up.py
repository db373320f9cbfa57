"""The stack as `rollbus up` starts it: what each service is handed (no processes started here)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.adapter.tokens import SessionTokens
from rollbus.services.stack.up import EXAMPLES, Stack, StackSettings, service_specs


def adapter_settings(spec_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> AdapterSettings:
    """The settings a freshly started adapter process reads from the environment the supervisor gives it."""
    with monkeypatch.context() as scope:
        for name, value in spec_env.items():
            scope.setenv(name, value)
        return AdapterSettings()


def test_a_restarted_adapter_accepts_the_session_tokens_its_predecessor_issued(tmp_path: Path, monkeypatch):
    """What failed: under `rollbus up` a killed adapter came back with a random signing key of its own and
    answered 401 to every agent in flight (their rollouts ended agent_crashed)."""
    stack = Stack("127.0.0.1:9", "ns", "http://127.0.0.1:1", "http://127.0.0.1:2", "adm", tmp_path, "key")
    (adapter,) = [s for s in service_specs(StackSettings(state_dir=tmp_path), stack) if s.name == "adapter"]
    before, after = adapter_settings(adapter.env, monkeypatch), adapter_settings(adapter.env, monkeypatch)
    token = SessionTokens(before.signing_key).issue("r-1", "a-1")
    grant = SessionTokens(after.signing_key).verify(token)
    assert grant is not None and grant.rollout_id == "r-1"
    assert stack.adapter_signing_key not in " ".join(adapter.argv)  # ps shows command lines
    other = Stack("127.0.0.1:9", "ns", "http://127.0.0.1:1", "http://127.0.0.1:2", "adm", tmp_path, "key")
    assert other.adapter_signing_key != stack.adapter_signing_key  # one per run, never a constant


def engine_argv(tmp_path: Path, **given) -> list[str]:
    stack = Stack("127.0.0.1:9", "ns", "http://127.0.0.1:1", "http://127.0.0.1:2", "adm", tmp_path, "key")
    specs = service_specs(StackSettings(state_dir=tmp_path, **given), stack)
    (engine,) = [s for s in specs if s.name == "engine"]
    return engine.argv


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("agent", ["claude_code", "codex"])
def test_the_engine_gets_each_harness_s_scripts_whatever_the_default_harness(tmp_path: Path, agent: str):
    """A dataset's rows choose their harness (metadata.agent), so the engine gets both sets of swe-mini
    scripts and answers each request with its harness's (--agent codex used to switch them for every row)."""
    argv = engine_argv(tmp_path, agent=agent)
    assert flag(argv, "--script") == str(EXAMPLES / "swe-mini" / "scripts")
    assert flag(argv, "--codex-script") == str(EXAMPLES / "swe-mini" / "scripts-codex")


def test_a_script_given_alone_serves_every_harness_and_a_codex_script_given_serves_codex(tmp_path: Path):
    mine, codex = tmp_path / "mine.json", tmp_path / "codex"
    alone = engine_argv(tmp_path, agent="codex", script=mine)
    assert flag(alone, "--script") == str(mine) and "--codex-script" not in alone
    both = engine_argv(tmp_path, script=mine, codex_script=codex)
    assert (flag(both, "--script"), flag(both, "--codex-script")) == (str(mine), str(codex))


def service_argv(tmp_path: Path, name: str, **given) -> list[str]:
    stack = Stack("127.0.0.1:9", "ns", "http://127.0.0.1:1", "http://127.0.0.1:2", "adm", tmp_path, "key")
    (spec,) = [s for s in service_specs(StackSettings(state_dir=tmp_path, **given), stack) if s.name == name]
    return spec.argv


def test_injected_infrastructure_failures_and_over_sampling_reach_the_runner_and_the_trainer(tmp_path: Path):
    assert flag(service_argv(tmp_path, "sandbox-runner"), "--inject-infra-failures") is None  # off: not named
    runner = service_argv(tmp_path, "sandbox-runner", inject_infra_failures=3)
    assert flag(runner, "--inject-infra-failures") == "3"
    assert flag(service_argv(tmp_path, "trainer", over_sample=2), "--over-sample") == "2"
    assert flag(service_argv(tmp_path, "trainer"), "--refill-dataset") is None  # off: not named
    rows = tmp_path / "rows.jsonl"
    assert flag(service_argv(tmp_path, "trainer", refill_dataset=rows), "--refill-dataset") == str(rows)


def test_the_sandbox_backend_reaches_the_runner_and_the_grader(tmp_path: Path):
    """``--sandbox-backend docker``: the agent and the grade both run in containers of each row's image (the
    runner's --backend docker, the grader's --backend docker); bwrap, the default, passes neither."""
    for name in ("sandbox-runner", "grader"):
        assert flag(service_argv(tmp_path, name, sandbox_backend="docker"), "--backend") == "docker"
        assert "--backend" not in service_argv(tmp_path, name)
    for settings in ("sandbox_runner.settings:RunnerSettings", "grader.settings:GraderSettings"):
        module, _, cls = settings.partition(":")
        backend = getattr(importlib.import_module(f"rollbus.services.{module}"), cls).model_fields["backend"]
        assert "docker" in backend.annotation.__args__  # the value the stack passes is one each accepts
