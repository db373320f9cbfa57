"""E2BSandbox against a fake of the SDK boundary that records every call (no E2B cloud is reachable here).

``FakeSDK`` stands for ``e2b.AsyncSandbox``: ``create(**kwargs)`` returns a ``FakeVM`` whose ``commands.run``
runs the command string as a real local ``bash -c`` (``background=True`` returns a handle with a ``pid``),
``commands.kill(pid)`` SIGKILLs it, ``files.read``/``files.write`` touch real paths and raise the SDK's real
``FileNotFoundException``, ``kill()`` records the VM's end. The backend is pointed at local directories for
its workdir and run dir, so its shell wrappers, the agent's history reduction (real git) and the remote
process-group kill all really run. Failures are injected as the SDK's real exception classes.

Left unexercised: the real API and envd (RPC transport, ``bash -l`` login environment, which pid envd
reports, what ``commands.kill`` reaches in the VM), server-side idempotency of ``idempotency_key``, what
``allow_internet_access=False`` and ``network.allow_out`` really block, users and permissions in the VM, and
whether a template holds git and the Claude Code binary.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import e2b
import pytest
from e2b import CommandExitException, CommandResult

from rollbus.sandbox import E2BSandbox, SandboxError, SandboxSpec, create_sandbox
from rollbus.sandbox.e2b_backend import E2BOptions, transient
from tests.waiting import until

EXAMPLE_REPO = Path(__file__).resolve().parents[1] / "examples" / "buggy_repo"


class FakeHandle:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self._proc = proc
        self.pid = proc.pid

    async def wait(self) -> CommandResult:
        out, err = await self._proc.communicate()
        result = dict(stdout=out.decode(), stderr=err.decode(), exit_code=self._proc.returncode, error=None)
        if self._proc.returncode:
            raise CommandExitException(**result)
        return CommandResult(**result)


class FakeCommands:
    def __init__(self, vm: FakeVM) -> None:
        self.vm = vm
        self.calls: list[dict[str, Any]] = []
        self.killed: list[int] = []
        self.fail_next: list[BaseException] = []

    async def run(
        self,
        cmd: str,
        background: bool | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = 60,
        **_: Any,
    ) -> Any:
        self.calls.append(
            {"cmd": cmd, "background": background, "envs": envs, "cwd": cwd, "timeout": timeout}
        )
        if self.fail_next:
            raise self.fail_next.pop(0)
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            cmd,
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", **(envs or {})},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        self.vm.procs.append(proc)
        handle = FakeHandle(proc)
        return handle if background else await handle.wait()

    async def kill(self, pid: int) -> bool:
        self.killed.append(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return True


class FakeFiles:
    def __init__(self) -> None:
        self.reads: list[str] = []
        self.fail_reads: list[BaseException] = []

    async def read(self, path: str, format: str = "text", **_: Any) -> str | bytearray:  # noqa: A002 - SDK name
        self.reads.append(path)
        if self.fail_reads:
            raise self.fail_reads.pop(0)
        try:
            data = Path(path).read_bytes()
        except FileNotFoundError as exc:
            raise e2b.FileNotFoundException(f"{path} not found") from exc
        return bytearray(data) if format == "bytes" else data.decode()

    async def write(self, path: str, data: str | bytes, **_: Any) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data.encode() if isinstance(data, str) else data)


class FakeVM:
    def __init__(self) -> None:
        self.sandbox_id = f"vm-{uuid.uuid4().hex[:6]}"
        self.procs: list[asyncio.subprocess.Process] = []
        self.commands = FakeCommands(self)
        self.files = FakeFiles()
        self.kills = 0

    async def kill(self) -> bool:
        self.kills += 1
        return True


class FakeSDK:
    """Stands for the ``e2b.AsyncSandbox`` class: only ``create`` is used."""

    def __init__(
        self,
        create_failures: list[BaseException] | None = None,
        setup_failures: list[BaseException] | None = None,
    ) -> None:
        self.creates: list[dict[str, Any]] = []
        self.vms: list[FakeVM] = []
        self._create_failures = create_failures or []
        self._setup_failures = setup_failures or []

    async def create(self, **kwargs: Any) -> FakeVM:
        self.creates.append(kwargs)
        if self._create_failures:
            raise self._create_failures.pop(0)
        vm = FakeVM()
        vm.commands.fail_next = list(self._setup_failures)
        self.vms.append(vm)
        return vm


def options(tmp_path: Path, **overrides: Any) -> E2BOptions:
    return E2BOptions(run_dir=str(tmp_path / "run"), backoff_s=0.0, poll_s=0.02, **overrides)


@pytest.fixture
async def vm(tmp_path: Path) -> AsyncIterator[tuple[E2BSandbox, FakeVM]]:
    sdk = FakeSDK()
    workdir = tmp_path / "ws"
    subprocess.run(["cp", "-a", str(EXAMPLE_REPO), str(workdir)], check=True)
    box = await E2BSandbox.create(role="grader", workdir=str(workdir), options=options(tmp_path), sdk=sdk)
    yield box, sdk.vms[0]
    await box.close()


def processes_named(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if (entry / "cmdline").read_bytes().split(b"\0")[0] == marker.encode():
                found.append(int(entry.name))
    return found


async def test_routing_metadata_network_and_idempotency(tmp_path: Path) -> None:
    meta_file = tmp_path / "meta.json"
    meta_file.write_text(json.dumps({"cluster": "eu-1"}))
    env = {
        "ROLLBUS_E2B_METADATA_FILE": str(meta_file),
        "ROLLBUS_E2B_IMAGE_METADATA_KEY": "docker_image",
        "ROLLBUS_E2B_TEMPLATE": "default-tpl",
    }
    opts = E2BOptions.from_env(env, run_dir=str(tmp_path / "run"), backoff_s=0.0)
    sdk = FakeSDK()
    (tmp_path / "a").mkdir()
    (tmp_path / "g").mkdir()
    agent = await E2BSandbox.create(
        role="agent",
        metadata={"image": "swe/x:1"},
        adapter_url="http://adapter.example:8000",
        workdir=str(tmp_path / "a"),
        options=opts,
        sdk=sdk,
        sandbox_id="sbx-a",
    )
    grader = await E2BSandbox.create(
        role="grader",
        metadata={"image": "swe/x:1", "e2b_template": "tpl-x"},
        workdir=str(tmp_path / "g"),
        options=opts,
        sdk=sdk,
        sandbox_id="sbx-g",
    )
    first, second = sdk.creates
    assert first["template"] == "default-tpl" and second["template"] == "tpl-x"
    assert first["metadata"] == {
        "cluster": "eu-1",
        "docker_image": "swe/x:1",
        "rollbus_sandbox_id": "sbx-a",
        "rollbus_role": "agent",
    }
    assert first["network"] == {"deny_out": ["0.0.0.0/0"], "allow_out": ["adapter.example"]}
    assert second["allow_internet_access"] is False and "network" not in second
    assert (first["idempotency_key"], second["idempotency_key"]) == ("sbx-a", "sbx-g")
    await agent.close()
    await grader.close()


async def test_a_bad_metadata_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text('{"n": 1}')
    with pytest.raises(SandboxError, match="JSON object of strings"):
        E2BOptions.from_env({"ROLLBUS_E2B_METADATA_FILE": str(tmp_path / "m.json")})


async def test_the_agent_repository_holds_the_base_commit_only(tmp_path: Path) -> None:
    repo = tmp_path / "ws"
    subprocess.run(["cp", "-a", str(EXAMPLE_REPO), str(repo)], check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"], ["tag", "v1"]):
        subprocess.run([*git, *args], cwd=repo, check=True)
    (repo / "calc.py").write_text("future\n")
    subprocess.run([*git, "commit", "-qam", "future"], cwd=repo, check=True)
    subprocess.run([*git, "reset", "-q", "--hard", "HEAD~1"], cwd=repo, check=True)
    box = await E2BSandbox.create(role="agent", workdir=str(repo), options=options(tmp_path), sdk=FakeSDK())
    done = await box.run(
        ["sh", "-c", "git log --all --oneline | wc -l; git tag | wc -l; git reflog | wc -l"], {}
    )
    assert done.stdout.split() == ["1", "0", "0"], done.stderr
    await box.close()


async def test_capture_patch_diffs_against_the_base_commit_recorded_at_boot(tmp_path: Path) -> None:
    """The runner takes every backend's patch through ``capture_patch``: here git in the VM diffs against the
    commit recorded at boot (an agent's commit moves nothing), leaves excluded paths out, and says when the
    cap cut it."""
    repo = tmp_path / "ws"
    subprocess.run(["cp", "-a", str(EXAMPLE_REPO), str(repo)], check=True)
    box = await E2BSandbox.create(role="agent", workdir=str(repo), options=options(tmp_path), sdk=FakeSDK())
    assert box.base_commit is not None
    edit = "echo '# edited' >> calc.py && mkdir -p .claude && echo x > .claude/s && echo n > new.txt"
    commit = "git -c user.name=a -c user.email=a@a commit -qam hide"
    assert (await box.run(["sh", "-c", f"{edit} && {commit}"], {})).exit_code == 0
    captured = await box.capture_patch(1 << 20, [".claude"])
    assert captured.failure is None and not captured.truncated, captured.error
    assert b"+# edited" in captured.patch and b"b/new.txt" in captured.patch
    assert b".claude" not in captured.patch
    cut = await box.capture_patch(100, [".claude"])
    assert cut.truncated and cut.patch == captured.patch[:100]
    await box.close()


async def test_a_sandbox_without_a_recorded_baseline_takes_no_patch(tmp_path: Path) -> None:
    """A grader's VM (or one made without ``create``) has no baseline: no patch against whatever HEAD is."""
    workdir = str(tmp_path / "g")
    box = await E2BSandbox.create(role="grader", workdir=workdir, options=options(tmp_path), sdk=FakeSDK())
    captured = await box.capture_patch(1 << 20)
    assert (captured.patch, captured.failure) == (b"", "git_failed") and "base commit" in captured.error
    await box.close()


async def test_only_transient_errors_are_retried(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    flaky = FakeSDK(create_failures=[e2b.SandboxUnreachableException("down"), e2b.RateLimitException("slow")])
    box = await E2BSandbox.create(
        role="grader", workdir=str(tmp_path / "w"), options=options(tmp_path), sdk=flaky, sandbox_id="same"
    )
    assert len(flaky.creates) == 3 and {c["idempotency_key"] for c in flaky.creates} == {"same"}
    await box.close()
    wrong = FakeSDK(
        create_failures=[e2b.AuthenticationException("bad key"), e2b.SandboxUnreachableException()]
    )
    with pytest.raises(SandboxError, match="bad key"):
        await E2BSandbox.create(
            role="grader", workdir=str(tmp_path / "w"), options=options(tmp_path), sdk=wrong
        )
    assert len(wrong.creates) == 1
    assert not transient(e2b.SandboxNotRunningException("gone")) and transient(ConnectionResetError())


async def test_a_sandbox_whose_setup_fails_is_killed(tmp_path: Path) -> None:
    sdk = FakeSDK(setup_failures=[e2b.InvalidArgumentException("no such dir")])
    with pytest.raises(SandboxError, match="setup failed"):
        await E2BSandbox.create(
            role="grader", workdir=str(tmp_path / "w"), options=options(tmp_path), sdk=sdk
        )
    assert sdk.vms[0].kills == 1  # the VM does not leak


class SlowSDK(FakeSDK):
    """``create`` that is still in flight when its caller gives up, and returns a VM afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.asked = asyncio.Event()  # the request reached the cloud

    async def create(self, **kwargs: Any) -> FakeVM:
        self.asked.set()
        await self.release.wait()
        return await super().create(**kwargs)


async def test_a_vm_that_starts_after_its_caller_was_cancelled_is_killed(tmp_path: Path) -> None:
    sdk = SlowSDK()
    creating = asyncio.create_task(
        E2BSandbox.create(role="grader", workdir=str(tmp_path / "w"), options=options(tmp_path), sdk=sdk)
    )
    await until(sdk.asked.is_set, "the create request in flight")
    creating.cancel()
    with pytest.raises(asyncio.CancelledError):
        await creating
    sdk.release.set()  # the cloud answers after all: a VM exists that nobody holds
    await until(lambda: sdk.vms and sdk.vms[0].kills, "the VM nobody holds killed")
    assert len(sdk.vms) == 1 and sdk.vms[0].kills == 1

async def test_exit_code_output_env_and_quoting(vm: tuple[E2BSandbox, FakeVM]) -> None:
    box, fake = vm
    done = await box.run(
        ["sh", "-c", 'echo "$GREETING"; printf "%s|" "two words" "it\'s" "$HOME"; echo e >&2; exit 3'],
        {"GREETING": "hi", "HOME": "/h"},
    )
    assert (done.exit_code, done.stdout, done.stderr, done.failure_kind) == (
        3,
        "hi\ntwo words|it's|/h|",
        "e\n",
        None,
    )
    call = fake.commands.calls[-1]
    assert (
        call["background"] is True
        and call["timeout"] == 0
        and call["envs"] == {"GREETING": "hi", "HOME": "/h"}
    )


async def test_long_runs_are_polled_and_survive_transient_read_errors(vm: tuple[E2BSandbox, FakeVM]) -> None:
    box, fake = vm
    fake.files.fail_reads = [e2b.SandboxUnreachableException("blip")]
    done = await box.run(["sh", "-c", "sleep 0.5; echo done"], {})
    assert (done.exit_code, done.stdout) == (0, "done\n")
    assert sum(path.endswith(".rc") for path in fake.files.reads) >= 3  # polled, not one blocking stream


async def test_timeout_kills_the_remote_process_group_and_keeps_output(vm: tuple[E2BSandbox, FakeVM]) -> None:
    box, fake = vm
    marker = f"rollbus-e2b-{uuid.uuid4().hex[:8]}"
    done = await box.run(
        ["bash", "-c", f"echo started; (exec -a {marker} sleep 300) & exec -a {marker} sleep 300"],
        {},
        timeout=1,
    )
    assert done.timed_out and done.failure_kind == "timeout" and done.exit_code < 0
    assert done.stdout == "started\n"
    assert fake.commands.killed and any("kill -9 -- -" in c["cmd"] for c in fake.commands.calls)
    await until(lambda: not processes_named(marker), "the killed process group gone")


async def test_a_cancelled_run_kills_the_remote_command(vm: tuple[E2BSandbox, FakeVM]) -> None:
    box, fake = vm
    marker = f"rollbus-e2b-{uuid.uuid4().hex[:8]}"
    task = asyncio.ensure_future(box.run(["bash", "-c", f"exec -a {marker} sleep 300"], {}, timeout=600))
    await until(lambda: processes_named(marker), "the remote command running")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: not processes_named(marker), "the cancelled command gone")
    assert fake.commands.killed and processes_named(marker) == []


async def test_output_is_capped_and_files_round_trip_and_close_is_idempotent(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    sdk = FakeSDK()
    box = await E2BSandbox.create(
        role="grader", workdir=str(tmp_path / "w"), options=options(tmp_path, output_bytes=1000), sdk=sdk
    )
    done = await box.run(["sh", "-c", "head -c 5000 /dev/zero"], {})
    assert done.failure_kind == "output_truncated" and done.output_dropped == 4000
    blob = bytes(range(256))
    await box.write_file(str(tmp_path / "w" / "b.bin"), blob)
    assert await box.read_file(str(tmp_path / "w" / "b.bin")) == blob
    async with box:
        pass
    await box.close()
    assert sdk.vms[0].kills == 1


async def test_create_sandbox_routes_a_spec_to_e2b(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    sdk = FakeSDK()
    spec = SandboxSpec(
        image=Path("swe/x:1"),
        role="grader",
        workdir=str(tmp_path / "w"),
        sandbox_id="sbx-s",
        metadata={"e2b_template": "tpl"},
    )
    box = await create_sandbox(spec, "e2b", options=options(tmp_path), sdk=sdk)
    [call] = sdk.creates
    assert (call["template"], call["metadata"]["image"], call["allow_internet_access"]) == (
        "tpl",
        "swe/x:1",
        False,
    )
    assert box.sandbox_id == "sbx-s"
    await box.close()
    with pytest.raises(ValueError, match="unknown sandbox backend 'podman'"):
        await create_sandbox(spec, "podman")  # docker is a backend now; a name nobody serves is refused
