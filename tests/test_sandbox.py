"""The process sandboxes, with real bwrap and real subprocesses: isolation, timeouts, exit codes, files."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollbus.sandbox import (
    BwrapSandbox,
    LocalSubprocessSandbox,
    Sandbox,
    SandboxPathError,
    bwrap_usable,
    prepare_repo,
)

EXAMPLE_REPO = Path(__file__).resolve().parents[1] / "examples" / "buggy_repo"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
needs_bwrap = pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")


@pytest.fixture(
    params=[
        pytest.param("bwrap", marks=needs_bwrap),
        "local",
        pytest.param("docker", marks=pytest.mark.docker),
    ]
)
async def sandbox(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Sandbox]:
    """Each backend over the same prepared repository (docker: a container of the cached base image)."""
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "repo")
    box: Sandbox
    if request.param == "docker":
        from rollbus.sandbox import docker_engine, docker_images
        from rollbus.sandbox.docker_backend import DockerSandbox

        client = docker_engine.client()
        image = docker_images.ensure_base_image(client)
        box = await DockerSandbox.create(image, client=client, workspace=workdir, scratch_root=tmp_path)
    elif request.param == "bwrap":
        box = await BwrapSandbox.create(workdir)
    else:
        box = LocalSubprocessSandbox(workdir)
    yield box
    await box.close()


@pytest.fixture
async def bwrap_box(tmp_path: Path) -> AsyncIterator[BwrapSandbox]:
    if not bwrap_usable():
        pytest.skip("bubblewrap cannot create namespaces here")
    box = await BwrapSandbox.create(prepare_repo(EXAMPLE_REPO, tmp_path / "repo"))
    yield box
    await box.close()


def processes_named(marker: str) -> list[int]:
    """Host pids whose argv[0] is ``marker`` (sandboxed processes are visible from the host)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
        if argv0 == marker.encode():
            found.append(int(entry.name))
    return found


async def test_exit_code_and_output_are_propagated(sandbox: Sandbox) -> None:
    done = await sandbox.run(["sh", "-c", "echo out; echo err >&2; exit 7"], ENV, timeout=30)
    assert (done.exit_code, done.stdout, done.stderr, done.timed_out) == (7, "out\n", "err\n", False)


async def test_an_agent_run_gets_its_secret_on_every_backend(sandbox: Sandbox) -> None:
    """The contract's agent keywords (``rollout._attempt`` passes them to whatever backend it booted): the
    local backend took neither and raised TypeError (mypy: its ``run`` was narrower than its base's)."""
    command = ["sh", "-c", 'echo "token=$RB_TOKEN"']
    done = await sandbox.run(command, ENV, timeout=30, agent=True, secret_env={"RB_TOKEN": "rb-7f3a"})
    assert (done.exit_code, done.stdout) == (0, "token=rb-7f3a\n"), done.stderr[-2000:]


async def test_failing_tests_of_the_example_repo_fail_inside(sandbox: Sandbox) -> None:
    done = await sandbox.run(["python3", "-m", "unittest"], ENV, timeout=60)
    assert done.exit_code != 0 and "FAILED (failures=2)" in done.stderr


async def test_timeout_kills_the_whole_process_tree(sandbox: Sandbox) -> None:
    marker = f"rollbus-sleeper-{uuid.uuid4().hex[:8]}"
    script = f"echo started; (exec -a {marker} sleep 300) & exec -a {marker} sleep 300"
    done = await sandbox.run(["bash", "-c", script], ENV, timeout=1)
    assert done.timed_out and done.exit_code != 0  # -9 from bwrap, 137 (128 + 9) from a killed container
    assert done.stdout == "started\n"  # output before the kill is kept
    assert processes_named(marker) == []


async def test_files_move_in_and_out_of_the_workspace(sandbox: Sandbox) -> None:
    await sandbox.write_file(f"{sandbox.workdir}/notes/in.txt", "from host")
    done = await sandbox.run(["sh", "-c", "cat notes/in.txt > out.txt"], ENV, timeout=30)
    assert done.exit_code == 0
    assert await sandbox.read_file(f"{sandbox.workdir}/out.txt") == b"from host"


async def test_symlink_out_of_the_workspace_is_not_followed_by_the_host(sandbox: Sandbox) -> None:
    await sandbox.run(["ln", "-s", "/etc/hostname", "leak"], ENV, cwd=sandbox.workdir, timeout=30)
    with pytest.raises(SandboxPathError, match="outside"):
        await sandbox.read_file(f"{sandbox.workdir}/leak")
    with pytest.raises(SandboxPathError):
        await sandbox.read_file("/etc/hostname")


async def test_bwrap_sees_workspace_and_home_at_fixed_paths_as_the_agent_user(
    bwrap_box: BwrapSandbox,
) -> None:
    done = await bwrap_box.run(["sh", "-c", 'pwd; id -un; echo "$HOME"'], {**ENV, "HOME": bwrap_box.home})
    assert done.stdout.split() == ["/workspace", "agent", "/home/agent"]


async def test_bwrap_writes_outside_the_workspace_do_not_reach_the_host(
    bwrap_box: BwrapSandbox, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"  # exists on the host, not mounted in the sandbox
    outside.mkdir()
    host_tmp = Path("/tmp") / f"rollbus-escape-{uuid.uuid4().hex}"
    script = (
        f"mkdir -p {outside} && echo x > {outside}/f; echo x > {host_tmp}; "
        "touch /usr/rollbus-escape; echo ok > /workspace/inside"
    )
    done = await bwrap_box.run(["sh", "-c", script], ENV, timeout=30)
    assert "Read-only file system" in done.stderr
    assert list(outside.iterdir()) == [] and not host_tmp.exists()
    assert not Path("/usr/rollbus-escape").exists()
    assert (bwrap_box.host_workdir / "inside").read_text() == "ok\n"


async def test_bwrap_network_none_cannot_reach_a_host_loopback_port(tmp_path: Path) -> None:
    if not bwrap_usable():
        pytest.skip("bubblewrap cannot create namespaces here")
    connections: list[str] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(await reader.read(100))
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connect = ["bash", "-c", f"echo hello > /dev/tcp/127.0.0.1/{port}"]
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "repo")
    results = {}
    for network in ("none", "loopback"):
        box = await BwrapSandbox.create(workdir, network=network)
        results[network] = await box.run(connect, ENV, timeout=30)
        await box.close()
    server.close()
    await server.wait_closed()
    assert results["none"].exit_code != 0 and "refused" in results["none"].stderr.lower()
    assert results["loopback"].exit_code == 0  # the control: the same probe works with --share-net
    assert connections == [b"hello\n"]


async def test_bwrap_home_is_private_to_each_sandbox(tmp_path: Path) -> None:
    if not bwrap_usable():
        pytest.skip("bubblewrap cannot create namespaces here")
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "repo")
    first, second = await BwrapSandbox.create(workdir), await BwrapSandbox.create(workdir)
    await first.run(["sh", "-c", "echo secret > $HOME/.token"], {**ENV, "HOME": first.home})
    done = await second.run(["sh", "-c", "cat $HOME/.token"], {**ENV, "HOME": second.home})
    assert done.exit_code != 0
    home = first.layout.home
    await first.close()
    await second.close()
    assert not home.exists() and os.path.exists(workdir)  # close drops HOME, never the caller's repo


async def test_a_process_in_its_own_session_escapes_only_the_local_backend(sandbox: Sandbox) -> None:
    """setsid escapes a process group, not a PID namespace nor a killed container; either way ``run`` returns
    after the timeout."""
    marker = f"rollbus-escapee-{uuid.uuid4().hex[:8]}"
    done = await sandbox.run(
        ["bash", "-c", f"setsid bash -c 'exec -a {marker} sleep 300' & sleep 300"], ENV, timeout=1
    )
    survivors = processes_named(marker)
    for pid in survivors:  # clean up what the weak backend let escape
        os.kill(pid, 9)
    assert done.timed_out
    assert len(survivors) == (1 if isinstance(sandbox, LocalSubprocessSandbox) else 0)
