"""The Codex CLI's install, command line and environment (rollbus.codex_cli), and a row's choice of agent."""

from __future__ import annotations

import json
import stat
import subprocess

import pytest

from rollbus import codex_cli
from rollbus.services.sandbox_runner import harnesses as agents
from rollbus.services.sandbox_runner.harnesses import codex
from rollbus.services.sandbox_runner.settings import RunnerSettings


def overrides(cmd: list[str]) -> dict[str, str]:
    return dict(cmd[i + 1].split("=", 1) for i, arg in enumerate(cmd) if arg == "-c")


def test_the_command_runs_headless_offline_and_keeps_a_dash_prompt_a_prompt() -> None:
    cmd = codex_cli.build_command(
        "--help me", base_url="http://127.0.0.1:8080/v1", model="m", catalog="/opt/codex/catalog.json",
        workdir="/workspace", binary="/opt/codex/codex", max_turn_seconds=60,
    )  # fmt: skip
    assert cmd[:2] == ["/opt/codex/codex", "exec"] and cmd[-2:] == ["--", "--help me"]
    assert "--dangerously-bypass-approvals-and-sandbox" in cmd and "--ephemeral" in cmd
    settings = overrides(cmd)
    for off in ("analytics.enabled", "feedback.enabled", "check_for_update_on_startup", "features.plugins",
                "features.apps"):  # fmt: skip
        assert settings[off] == "false", off
    assert settings["agents.enabled"] == "true"  # sub-agents train (tests/test_e2e_codex_subagents.py)
    assert settings["web_search"] == '"disabled"' and settings["model_provider"] == '"rollbus"'
    provider = settings["model_providers.rollbus"]
    assert 'base_url = "http://127.0.0.1:8080/v1"' in provider and 'wire_api = "responses"' in provider
    assert "request_max_retries = 0" in provider and "stream_max_retries = 2" in provider
    assert "stream_idle_timeout_ms = 60000" in provider


def test_the_environment_is_complete_and_carries_the_token_only_as_the_provider_key() -> None:
    env = codex_cli.build_env("tok", home="/home/agent", extra={"X": "1"})
    assert env == {"HOME": "/home/agent", "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                   "CODEX_HOME": "/home/agent", codex_cli.TOKEN_ENV: "tok", "X": "1"}  # fmt: skip


def test_the_catalog_offers_freeform_apply_patch_and_no_search_and_is_written_once() -> None:
    (entry,) = codex_cli.model_catalog("m", instructions="be brief")["models"]
    assert entry["slug"] == "m" and entry["base_instructions"] == "be brief"
    assert entry["apply_patch_tool_type"] == "freeform" and entry["supports_search_tool"] is False
    path = codex_cli.catalog_file("m", instructions="be brief")
    assert json.loads(path.read_text())["models"] == [entry]
    assert codex_cli.catalog_file("m", instructions="be brief") == path
    assert codex_cli.catalog_file("m", instructions="other") != path


@pytest.mark.parametrize("context_length", [4096, 32768, 131072])
def test_codex_compacts_while_its_compaction_request_still_fits_the_served_context(context_length) -> None:
    """What was wrong: the catalog said 65,536 tokens while the adapter serves 32,768 by default, so a long
    Codex episode met the adapter's 400 "prompt is too long" (fatal to Codex) before it ever compacted. The
    window is now the served one, and Codex compacts while a history grown by one more tool output, plus the
    checkpoint message, is still a prompt the adapter takes."""
    cmd = codex.command("fix it", base_url="http://a", model="m", workdir="/w", timeout=60,
                               tool_env={}, context_length=context_length)  # fmt: skip
    settings = overrides(cmd)
    limit = int(settings["model_auto_compact_token_limit"])
    assert int(settings["model_context_window"]) == context_length
    (entry,) = codex_cli.model_catalog("m", context_window=context_length)["models"]
    assert entry["context_window"] == context_length
    grown = limit + entry["truncation_policy"]["limit"] + codex_cli.CHECKPOINT_TOKENS
    assert grown <= context_length  # the largest compaction request is still under the adapter's refusal
    assert limit >= context_length // 2  # and Codex does not compact at every turn
    catalog = json.loads(codex_cli.catalog_file("m", context_window=context_length).read_text())
    assert catalog["models"][0]["context_window"] == context_length
    assert codex.HARNESS.host_files(RunnerSettings(model="m", context_length=context_length)) == {
        str(codex_cli.execute_only_binary()): codex_cli.SANDBOX_BINARY,
        str(codex_cli.catalog_file("m", context_window=context_length)): codex.CATALOG,
    }


def test_the_installed_binary_is_the_pinned_version_and_its_sandbox_copy_is_execute_only() -> None:
    binary = codex_cli.fetch()  # installed by bootstrap: no download here
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip().endswith(codex_cli.VERSION)
    copy = codex_cli.execute_only_binary()
    assert stat.S_IMODE(copy.stat().st_mode) == 0o111 and copy.stat().st_size == binary.stat().st_size


@pytest.mark.parametrize(
    ("metadata", "default", "expected"),
    [({}, "claude_code", "claude_code"), ({}, "codex", "codex"), ({"agent": "codex"}, "claude_code", "codex"),
     ({"agent": "claude_code"}, "codex", "claude_code")],
)  # fmt: skip
def test_a_row_chooses_its_agent_and_the_runner_gives_the_default(metadata, default, expected) -> None:
    assert agents.chosen(metadata, default) == expected


def test_a_row_listing_harnesses_gives_them_to_its_samples_in_turn_so_a_group_compares_them() -> None:
    """What was missing: a group is one row, so a group ran under one harness and could not compare two."""
    both = {"agent": ["claude_code", "codex"]}
    assert [agents.chosen(both, "claude_code", k) for k in range(5)] == ["claude_code", "codex"] * 2 + [
        "claude_code"
    ]
    assert [agents.chosen({"agent": ["codex"]}, "claude_code", k) for k in range(2)] == ["codex", "codex"]


@pytest.mark.parametrize("bad", ["aider", "", None, [], ["codex", "aider"], [["codex"]], 1])
def test_an_unknown_agent_is_refused(bad) -> None:
    with pytest.raises(agents.UnknownAgent, match="metadata.agent"):
        agents.chosen({"agent": bad}, "claude_code")


def test_the_commands_it_runs_inherit_only_core_variables_and_the_tool_environment() -> None:
    cmd = codex_cli.build_command(
        "p",
        base_url="http://a/v1",
        model="m",
        catalog="/c",
        workdir="/w",
        tool_env={"PYTHONDONTWRITEBYTECODE": "1"},
    )
    settings = overrides(cmd)
    assert settings["shell_environment_policy.inherit"] == '"core"'
    assert settings["shell_environment_policy.set"] == '{"PYTHONDONTWRITEBYTECODE" = "1"}'
