"""The sandbox runner's ``--backend e2b`` attempt, against the fake of the E2B SDK boundary (``FakeSDK``).

The fake (``tests/test_sandbox_e2b.py``) runs every command the runner sends "into the VM" as a real local
``bash -c`` and its file calls on real paths, so what really runs here: the E2B backend's detached start,
polling, remote process-group kill and history reduction; the runner's boot, the install scripts (a real
``tar xf`` of a host-decompressed ``.tar.xz``, a real ``npm install -g --offline`` of an npm-packed tarball),
the ``node --version`` / ``claude --version`` probes, the CLI's command line and environment, the patch taken
by real git in the "VM" against the recorded base commit, the host-side cap and exclusions, the VM's kill.
The VM's PATH is a directory of the host's tools without node, npm or claude, so the template "lacks" them.

Left unexercised: the real E2B API and envd (which user runs the commands, whether ``sudo -n`` works for the
install dir, whether the login shell keeps the PATH passed, what ``commands.kill`` reaches), the network
policy (``allow_out`` to the adapter's host only is requested, never enforced here), what real templates
contain, the real Node 22 and Claude Code tarballs and their download by URL (the fake Node tarball wraps the
host's node and npm; the fake Claude Code package is a shell script that edits the repository as an agent
would), and the real CLI talking to the adapter at its public URL (the adapter's sessions API is a
recording stub: it is not what this file tests).
"""

from __future__ import annotations

import asyncio
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path
from typing import Any

import e2b
import pytest

from rollbus.sandbox import apply_patch
from rollbus.sandbox.e2b_backend import E2BOptions
from rollbus.services.sandbox_runner.outcome import diff_event
from rollbus.services.sandbox_runner.rollout import RunnerKit, run_task
from rollbus.services.sandbox_runner.settings import RunnerSettings
from rollbus.settings import SettingsError
from tests.test_sandbox_e2b import EXAMPLE_REPO, FakeSDK, processes_named
from tests.waiting import until

PUBLIC_URL = "https://adapter.example:8443"
NPM_CLI = Path("/usr/lib/node_modules/npm/bin/npm-cli.js")
HIDDEN = {"node", "npm", "npx", "corepack", "claude"}
FAKE_CLAUDE = """#!/bin/bash
if [ "$1" = --version ]; then echo "2.1.197 (Claude Code)"; exit 0; fi
mkdir -p .claude
printf '%s\\n' "$@" > .claude/args
env > .claude/env
case "$2" in HANG:*) exec -a "${2#HANG:}" sleep 300;; esac
sed -i 's/range(1, n))/range(1, n + 1))/' calc.py
echo "a new file" > notes.txt
echo '{"type":"result","subtype":"success","num_turns":3}'
"""
FAKE_NODE = '#!/bin/sh\nif [ "$1" = --version ]; then echo v22.11.0; exit 0; fi\nexec /usr/bin/node "$@"\n'


class RecordingSessions:
    """Stands for the adapter's sessions API (``AdapterSessions``): a token per attempt, closes recorded."""

    def __init__(self) -> None:
        self.opened: list[str] = []
        self.closed: list[str | None] = []

    async def open(self, rollout_id: str, attempt_id: str, harness: str) -> str:
        assert harness == "claude_code"  # the token opens Claude Code's route (/v1/messages) only
        self.opened.append(attempt_id)
        return f"tok-{attempt_id}"

    async def close(self, rollout_id: str, attempt_id: str | None) -> None:
        self.closed.append(attempt_id)


def _add(tar: tarfile.TarFile, name: str, text: str, mode: int = 0o755) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(text.encode()), mode
    tar.addfile(info, io.BytesIO(text.encode()))


def node_tarball(path: Path) -> Path:
    """A stand-in for node-v22-linux-x64.tar.xz: bin/node and bin/npm wrapping the host's."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        _add(tar, "node-v22.11.0-linux-x64/bin/node", FAKE_NODE)
        _add(tar, "node-v22.11.0-linux-x64/bin/npm", f'#!/bin/sh\nexec node {NPM_CLI} "$@"\n')
    path.write_bytes(lzma.compress(raw.getvalue()))
    return path


def claude_tarball(path: Path, script: str = FAKE_CLAUDE, *, native: bool = False) -> Path:
    """An npm-packed package (``package/`` prefix) whose ``claude`` bin is the scripted agent; ``native``:
    shaped as the platform package (no bin; the executable ``claude`` at its root)."""
    manifest: dict[str, Any] = {"name": "@anthropic-ai/claude-code", "version": "2.1.197"}
    if native:
        manifest["name"] += "-linux-x64"
    else:
        manifest["bin"] = {"claude": "claude"}
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, "package/package.json", json.dumps(manifest), 0o644)
        _add(tar, "package/claude", script)
    return path


def vm_path(dest: Path, extra: dict[str, str] | None = None) -> Path:
    """The template's PATH: the host's tools, minus node, npm and claude (plus ``extra`` scripts)."""
    dest.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name not in HIDDEN:
            (dest / tool.name).symlink_to(tool)
    for name, text in (extra or {}).items():
        (dest / name).write_text(text)
        (dest / name).chmod(0o755)
    return dest


@pytest.fixture
def rig(tmp_path: Path) -> dict[str, Any]:
    if not NPM_CLI.is_file() or shutil.which("node", path="/usr/bin") is None:
        pytest.fail("this test needs the host's node and npm (installed with the Claude Code CLI)")
    (tmp_path / "ws").mkdir()
    shutil.copytree(EXAMPLE_REPO, tmp_path / "ws", dirs_exist_ok=True)
    return {
        "tmp": tmp_path,
        "given": {
            "backend": "e2b",
            "bootstrap_servers": "127.0.0.1:1",
            "state_dir": str(tmp_path / "state"),
            "adapter_url": "http://127.0.0.1:9",
            "public_adapter_url": PUBLIC_URL,
            "node_tarball": str(node_tarball(tmp_path / "node-v22.11.0-linux-x64.tar.xz")),
            "claude_code_tarball": str(claude_tarball(tmp_path / "claude-code-2.1.197.tgz")),
            "e2b_install_dir": str(tmp_path / "opt" / "agent"),
            "e2b_path": str(vm_path(tmp_path / "vmbin")),
        },  # fmt: skip
    }


def task(tmp: Path, prompt: str = "Fix sum_to.") -> dict[str, Any]:
    metadata = {"image": "swe/calc:1", "workdir": str(tmp / "ws"), "problem_statement": prompt,
                "eval_cmd": "python3 -m unittest -q  # grading material"}  # fmt: skip
    return {"rollout_id": "calc-1", "group_id": "g", "group_size": 1, "metadata": json.dumps(metadata)}


def kit_for(rig: dict[str, Any], **given: Any) -> tuple[RunnerKit, FakeSDK, RecordingSessions]:
    settings = RunnerSettings.load({**rig["given"], **given})
    sdk, sessions = FakeSDK(), RecordingSessions()
    options = E2BOptions(run_dir=str(rig["tmp"] / "run"), backoff_s=0.0, poll_s=0.02)
    return RunnerKit(settings, sessions, sdk=sdk, e2b_options=options), sdk, sessions  # type: ignore[arg-type]


def inside(rig: dict[str, Any], name: str) -> str:
    return (rig["tmp"] / "ws" / ".claude" / name).read_text()


async def test_a_full_attempt_installs_the_agent_runs_it_and_publishes_its_patch(rig: dict[str, Any]) -> None:
    kit, sdk, sessions = kit_for(rig)
    one = task(rig["tmp"])
    outcome = await run_task(kit, one, "att-e2b-1")
    event = diff_event(one, outcome)
    assert (event.failure_kind, event.turns, event.exit_status) == (None, 3, 0), event.error
    patch = event.patch
    assert b"+    return sum(range(1, n + 1))" in patch and b"b/notes.txt" in patch
    assert b".claude" not in patch
    fresh = rig["tmp"] / "fresh"
    shutil.copytree(EXAMPLE_REPO, fresh)
    assert apply_patch(fresh, patch) and "range(1, n + 1)" in (fresh / "calc.py").read_text()
    # the CLI: the attempt's token, the adapter's public URL, the installed tools first, the local path's args
    env = dict(line.split("=", 1) for line in inside(rig, "env").splitlines() if "=" in line)
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_AUTH_TOKEN"]) == (PUBLIC_URL, "tok-att-e2b-1")
    assert env["PATH"].startswith(f"{rig['given']['e2b_install_dir']}/cli/bin:")
    args = inside(rig, "args").splitlines()
    assert args[:2] == ["-p", "Fix sum_to."] and args[-3:] == ["--disallowedTools", "WebFetch", "WebSearch"]
    # the VM: routed by the image, the adapter's host its only way out, no grading material, killed at the end
    [create] = sdk.creates
    assert create["metadata"]["image"] == "swe/calc:1" and "eval_cmd" not in json.dumps(create)
    assert create["network"] == {"deny_out": ["0.0.0.0/0"], "allow_out": ["adapter.example"]}
    [vm] = sdk.vms
    cmds = [c["cmd"] for c in vm.commands.calls]
    assert any("tar xf" in c for c in cmds) and any("npm install -g" in c for c in cmds)
    agent = next(c for c in vm.commands.calls if "--disallowedTools" in c["cmd"])
    assert agent["background"] is True  # started detached, then polled
    assert f"{rig['given']['e2b_install_dir']}/cli/bin/claude -p" in agent["cmd"]  # by absolute path
    assert vm.kills == 1 and sessions.opened == ["att-e2b-1"] and sessions.closed == ["att-e2b-1"]


async def test_a_harness_without_an_e2b_install_is_a_bad_task_before_any_vm(rig: dict[str, Any]) -> None:
    kit, sdk, sessions = kit_for(rig, agent="codex")
    outcome = await run_task(kit, task(rig["tmp"]))
    assert outcome.failure_kind == "bad_task" and "codex" in (outcome.error or "")
    assert sdk.creates == [] and sessions.opened == []


async def test_a_template_that_has_node_and_claude_installs_nothing(rig: dict[str, Any]) -> None:
    tools = {"node": FAKE_NODE, "npm": f'#!/bin/sh\nexec node {NPM_CLI} "$@"\n', "claude": FAKE_CLAUDE}
    kit, sdk, _ = kit_for(rig, e2b_path=str(vm_path(rig["tmp"] / "template-bin", tools)))
    outcome = await run_task(kit, task(rig["tmp"]))
    assert outcome.failure_kind is None and b"range(1, n + 1)" in outcome.patch, outcome.error
    cmds = [c["cmd"] for c in sdk.vms[0].commands.calls]
    assert not any("tar xf" in c or "npm install" in c for c in cmds)


async def test_the_native_platform_package_is_linked_as_claude(rig: dict[str, Any]) -> None:
    native = claude_tarball(rig["tmp"] / "claude-code-linux-x64-2.1.197.tgz", native=True)
    kit, sdk, _ = kit_for(rig, claude_code_tarball=str(native))
    outcome = await run_task(kit, task(rig["tmp"]))
    assert outcome.failure_kind is None and b"range(1, n + 1)" in outcome.patch, outcome.error
    link = Path(rig["given"]["e2b_install_dir"]) / "cli" / "bin" / "claude"
    assert link.is_symlink() and "claude-code-linux-x64" in os.readlink(link)


async def test_an_install_failure_is_install_failed_and_the_vm_is_killed(rig: dict[str, Any]) -> None:
    broken = rig["tmp"] / "broken.tgz"
    broken.write_bytes(b"not a tarball at all")
    kit, sdk, sessions = kit_for(rig, claude_code_tarball=str(broken))
    outcome = await run_task(kit, task(rig["tmp"]))
    assert outcome.failure_kind == "install_failed" and "claude-code.tgz" in (outcome.error or "")
    assert sdk.vms[0].kills == 1 and sessions.opened == []  # no session, no token was ever handed out


async def test_a_timeout_kills_the_remote_agent_and_the_vm(rig: dict[str, Any]) -> None:
    marker = f"rollbus-e2b-agent-{uuid.uuid4().hex[:8]}"
    kit, sdk, sessions = kit_for(rig, agent_timeout=1.0)
    outcome = await run_task(kit, task(rig["tmp"], f"HANG:{marker}"))
    assert outcome.failure_kind == "timeout" and outcome.exit_status < 0
    [vm] = sdk.vms
    assert vm.commands.killed and any("kill -9 -- -" in c["cmd"] for c in vm.commands.calls)
    await until(lambda: not processes_named(marker), "the killed agent gone")
    assert vm.kills == 1 and sessions.closed == [outcome.attempt_id]


async def test_a_cancelled_attempt_kills_the_remote_agent_and_the_vm(rig: dict[str, Any]) -> None:
    marker = f"rollbus-e2b-agent-{uuid.uuid4().hex[:8]}"
    kit, sdk, sessions = kit_for(rig)
    running = asyncio.ensure_future(run_task(kit, task(rig["tmp"], f"HANG:{marker}")))
    await until(lambda: processes_named(marker), "the agent running")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await until(lambda: not processes_named(marker), "the cancelled agent gone")
    assert sdk.vms[0].kills == 1 and len(sessions.closed) == 1


async def test_an_agent_that_breaks_its_repository_is_patch_failed(rig: dict[str, Any]) -> None:
    wrecker = FAKE_CLAUDE.replace("sed -i", "rm -rf .git; sed -i")
    kit, sdk, _ = kit_for(rig, claude_code_tarball=str(claude_tarball(rig["tmp"] / "w.tgz", wrecker)))
    outcome = await run_task(kit, task(rig["tmp"]))
    assert (outcome.failure_kind, outcome.patch) == ("patch_failed", b"") and "git diff" in (
        outcome.error or ""
    )
    assert sdk.vms[0].kills == 1


async def test_a_commit_by_the_agent_does_not_move_the_baseline(rig: dict[str, Any]) -> None:
    committer = FAKE_CLAUDE.replace(
        "echo '{", "git -c user.name=a -c user.email=a@a commit -qam hide; echo '{"
    )
    kit, _, _ = kit_for(rig, claude_code_tarball=str(claude_tarball(rig["tmp"] / "c.tgz", committer)))
    outcome = await run_task(kit, task(rig["tmp"]))
    assert outcome.failure_kind is None and b"+    return sum(range(1, n + 1))" in outcome.patch


def test_backend_e2b_without_tarballs_fails_at_start_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="needs --node-tarball and --claude-code-tarball"):
        RunnerSettings.load({"backend": "e2b", "bootstrap_servers": "127.0.0.1:1"})
    with pytest.raises(SettingsError, match="--node-tarball="):
        RunnerSettings.load({"node_tarball": str(tmp_path / "missing.tar.xz"), "bootstrap_servers": "x:1"})
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("E2B_API_KEY", None)
    node, cli = node_tarball(tmp_path / "n.tar.xz"), claude_tarball(tmp_path / "c.tgz")
    base = [
        sys.executable,
        "-m",
        "rollbus",
        "sandbox-runner",
        "--backend",
        "e2b",
        "--bootstrap-servers",
        "x:1",
    ]
    for args, why in (
        (["--node-tarball", str(node)], "--claude-code-tarball"),
        (["--node-tarball", str(node), "--claude-code-tarball", str(cli)], "E2B_API_KEY is not set"),
    ):
        done = subprocess.run(
            [*base, *args], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert why in done.stderr


async def test_a_vm_that_never_boots_is_boot_failed_after_the_retries(rig: dict[str, Any]) -> None:
    kit, _, sessions = kit_for(rig, boot_backoff=0.0)
    kit.sdk = FakeSDK(create_failures=[e2b.AuthenticationException("bad key") for _ in range(3)])
    outcome = await run_task(kit, task(rig["tmp"]))
    assert outcome.failure_kind == "boot_failed" and "bad key" in (outcome.error or "")
    keys = [c["idempotency_key"] for c in kit.sdk.creates]
    assert len(keys) == 3 == len(set(keys)) and sessions.opened == []  # each retry a new VM id


async def test_an_oversized_patch_is_cut_in_the_vm_and_capped_on_the_host(rig: dict[str, Any]) -> None:
    flooder = FAKE_CLAUDE.replace('echo "a new file" > notes.txt', "seq 1 5000 > notes.txt")
    kit, sdk, _ = kit_for(
        rig, patch_max_bytes=1024, claude_code_tarball=str(claude_tarball(rig["tmp"] / "f.tgz", flooder))
    )
    outcome = await run_task(kit, task(rig["tmp"]))
    assert (outcome.failure_kind, outcome.patch_truncated) == ("patch_too_large", True)
    assert len(outcome.patch) <= 1024 and outcome.patch.endswith(b"\n")
    assert any("head -c 1025" in c["cmd"] for c in sdk.vms[0].commands.calls)
