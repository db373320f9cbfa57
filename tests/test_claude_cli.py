"""Installing the pinned CLI from npm and the command line / environment we start it with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollbus import claude_cli, npm_binary


@pytest.fixture(scope="module")
def cli_binary() -> Path:
    return claude_cli.fetch()


def test_fetched_binary_is_the_pinned_native_cli(cli_binary: Path) -> None:
    done = subprocess.run(
        [str(cli_binary), "--version"], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split()[0] == claude_cli.VERSION
    assert cli_binary == claude_cli.binary_path()
    assert cli_binary.is_relative_to(claude_cli.install_dir())


def test_fetch_is_a_no_op_once_installed(cli_binary: Path) -> None:
    # An npm that cannot run proves fetch() never reaches it.
    assert claude_cli.fetch(npm="/nonexistent/npm") == cli_binary


def test_module_entry_point_prints_the_binary(cli_binary: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rollbus.claude_cli", "fetch"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, str(cli_binary))


def test_failed_install_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE", str(tmp_path))
    with pytest.raises(claude_cli.CliInstallError, match="failed"):
        claude_cli.fetch(npm="false")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(claude_cli.CliNotInstalled):
        claude_cli.binary_path()


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_command_is_headless_streaming_and_bypasses_prompts() -> None:
    cmd = claude_cli.build_command(
        "fix it", model="m", max_turns=7, binary="/opt/claude", tools=["Read", "Edit"]
    )
    assert cmd[:3] == ["/opt/claude", "-p", "fix it"]
    assert flag(cmd, "--output-format") == "stream-json" and "--verbose" in cmd
    assert flag(cmd, "--permission-mode") == "bypassPermissions"
    assert (flag(cmd, "--model"), flag(cmd, "--max-turns"), flag(cmd, "--tools")) == ("m", "7", "Read,Edit")
    assert cmd[cmd.index("--disallowedTools") + 1 :] == ["WebFetch", "WebSearch"]


def test_command_keeps_default_tools_unless_restricted() -> None:
    assert "--tools" not in claude_cli.build_command("p", model="m", max_turns=1)


def test_env_is_complete_and_points_only_at_the_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "host-secret")
    env = claude_cli.build_env(
        "http://127.0.0.1:9/x",
        "tok",
        model="policy",
        max_output_tokens=4096,
        extra={"CLAUDE_CODE_EXTRA_BODY": "{}"},
    )
    assert "ANTHROPIC_API_KEY" not in env
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"]) == ("http://127.0.0.1:9/x", "tok")
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_SMALL_FAST_MODEL"] == env["CLAUDE_CODE_SUBAGENT_MODEL"]
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == env["IS_SANDBOX"] == "1"
    assert env["CLAUDE_CODE_EXTRA_BODY"] == "{}"


def test_the_execute_only_copy_is_made_once_and_remade_when_it_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy sandboxes run (mode 0111: nobody but root reads it, so the kernel makes the CLI non-dumpable);
    a copy someone made readable is replaced, never trusted."""
    monkeypatch.setenv("ROLLBUS_CACHE", str(tmp_path))
    installed = claude_cli.install_dir() / "pkg" / "claude"
    installed.parent.mkdir(parents=True)
    installed.write_bytes(b"\x7fELF native cli")
    installed.chmod(0o755)
    (claude_cli.install_dir() / npm_binary.MARKER).write_text('{"binary": "pkg/claude"}')
    copy = claude_cli.execute_only_binary()
    first = copy.stat()
    assert (copy.read_bytes(), first.st_mode & 0o7777) == (installed.read_bytes(), 0o111)
    assert claude_cli.execute_only_binary().stat().st_ino == first.st_ino  # made once
    copy.chmod(0o755)
    assert claude_cli.execute_only_binary().stat().st_mode & 0o7777 == 0o111
    assert installed.stat().st_mode & 0o7777 == 0o755  # the installed binary itself is left as it is


def test_old_npms_second_platform_package_is_set_aside_by_libc(tmp_path: Path) -> None:
    """npm 9 (Debian's) installs the glibc and the musl build side by side; the one for this libc is kept."""
    glibc = tmp_path / "claude-code-linux-x64" / "claude"
    musl = tmp_path / "claude-code-linux-x64-musl" / "claude"
    assert npm_binary.for_this_libc([glibc, musl], "glibc") == [glibc]
    assert npm_binary.for_this_libc([glibc, musl], "") == [musl]  # platform.libc_ver() names no glibc
    assert npm_binary.for_this_libc([glibc], "") == [glibc]
    two = [glibc, glibc.with_name("other")]
    assert npm_binary.for_this_libc(two, "glibc") == two  # still two: the caller's error names them
