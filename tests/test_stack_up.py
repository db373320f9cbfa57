"""The stack as `rollbus up` starts it: what each service is handed (no processes started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollbus.services.adapter.sessions import SessionTokens
from rollbus.services.adapter.settings import AdapterSettings
from rollbus.services.stack.up import Stack, StackSettings, service_specs


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
