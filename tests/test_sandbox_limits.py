"""Each limit of a local sandbox holds, and a hit comes back as its named failure kind (real cgroups here).

The cgroup v2 writer is also checked against a directory laid out like a v2 hierarchy, since this host has
v1 controllers: what the kernel does with those files on a real v2 host stays unexercised here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollbus.sandbox import (
    BwrapSandbox,
    Limits,
    SandboxSpec,
    bwrap_usable,
    create_local,
    git_diff,
    prepare_repo,
)
from rollbus.sandbox.bwrap_host import SCRATCH_ROOT
from rollbus.sandbox.limits import Cgroups, enforcement, failure_from_counters, rlimits
from rollbus.sandbox.process import BoundedOutput, CappedBytes
from rollbus.sandbox.spec import sweep_stale

EXAMPLE_REPO = Path(__file__).resolve().parents[1] / "examples" / "buggy_repo"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
MIB = 1 << 20
needs_bwrap = pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")


async def run_limited(limits: Limits, script: str, timeout: float = 60) -> tuple[BwrapSandbox, object]:
    async with await create_local(SandboxSpec(image=EXAMPLE_REPO, limits=limits)) as box:
        done = await box.run(["sh", "-c", script], ENV, timeout=timeout)
    return box, done


@needs_bwrap
async def test_memory_limit_kills_and_is_named() -> None:
    box, done = await run_limited(Limits(memory_bytes=64 * MIB), "python3 -c 'x = bytearray(400 << 20)'")
    assert done.failure_kind == "memory_limit" and done.exit_code != 0
    assert box.enforced["memory"] == "cgroup v1"


@needs_bwrap
async def test_every_process_of_a_command_is_in_each_of_the_sandboxs_cgroups() -> None:
    """The launcher joins each controller's group before bwrap starts: all it forks is counted everywhere."""
    async with await create_local(SandboxSpec(image=EXAMPLE_REPO)) as box:
        assert box.cgroups is not None and set(box.cgroups.dirs) == {"memory", "pids", "cpu"}
        run = asyncio.ensure_future(box.run(["sh", "-c", "sleep 3 & sleep 3 & wait"], ENV))
        members: dict[str, set[str]] = {}
        for _ in range(100):
            await asyncio.sleep(0.05)
            members = {c: set((d / "cgroup.procs").read_text().split()) for c, d in box.cgroups.dirs.items()}
            if all(len(pids) >= 4 for pids in members.values()):  # bwrap, its init, sh and two sleeps
                break
        run.cancel()
    assert all(len(pids) >= 4 for pids in members.values()), members
    assert members["memory"] == members["pids"] == members["cpu"]


@needs_bwrap
async def test_a_fork_bomb_hits_the_pids_limit() -> None:
    _, done = await run_limited(Limits(pids=16), "for i in $(seq 64); do sleep 2 & done; wait")
    assert done.failure_kind == "pids_limit"
    assert "fork" in done.stderr.lower() or "resource temporarily unavailable" in done.stderr.lower()


@needs_bwrap
async def test_wall_clock_timeout_is_named() -> None:
    _, done = await run_limited(Limits(), "sleep 60", timeout=1)
    assert done.timed_out and done.failure_kind == "timeout"


@needs_bwrap
async def test_cpu_time_limit_is_named() -> None:
    _, done = await run_limited(Limits(cpu_time_s=1), "python3 -c 'while True: pass'")
    assert done.failure_kind == "cpu_limit", done


@needs_bwrap
async def test_tmp_is_size_capped() -> None:
    _, done = await run_limited(Limits(tmp_bytes=1 * MIB), "dd if=/dev/zero of=/tmp/big bs=1M count=8")
    assert done.exit_code != 0 and done.failure_kind == "disk_full"


@needs_bwrap
async def test_the_workspace_is_size_capped_and_a_full_disk_is_named() -> None:
    async with await create_local(SandboxSpec(image=EXAMPLE_REPO, limits=Limits(disk_bytes=1 * MIB))) as box:
        done = await box.run(["sh", "-c", "dd if=/dev/zero of=big bs=1M count=3"], ENV)
        assert done.failure_kind == "disk_full" and "No space left" in done.stderr
        assert (box.host_workdir / "big").stat().st_size <= 1 * MIB  # held while writing, not found after
        assert box.enforced["disk"].startswith("tmpfs size")
        assert "diff --git a/big b/big" in git_diff(box.host_workdir)  # the baseline is off the full disk


@needs_bwrap
async def test_home_is_size_capped_and_a_full_home_is_named() -> None:
    """As root HOME is a tmpfs of the sandbox's disk size: the write fails, and the kind says why."""
    script = "dd if=/dev/zero of=/home/agent/big bs=1M count=3; ls -s --block-size=1 /home/agent/big"
    box, done = await run_limited(Limits(disk_bytes=2 * MIB), script)
    assert done.exit_code == 0 and done.failure_kind == "disk_full" and "No space left" in done.stderr
    assert int(done.stdout.split()[0]) <= 2 * MIB
    assert box.enforced["disk"].startswith("tmpfs size (workspace and HOME)")


@needs_bwrap
async def test_stale_sandboxes_of_a_dead_runner_are_swept(tmp_path: Path) -> None:
    box = await create_local(SandboxSpec(image=EXAMPLE_REPO))
    data = box.host_workdir.parent
    cgroups = list(box.cgroups.dirs.values()) if box.cgroups else []
    dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True).stdout.strip()
    (data / "owner.pid").write_text(dead)  # as if the runner that made it had been killed -9
    legacy = await BwrapSandbox.create(prepare_repo(EXAMPLE_REPO, tmp_path / "repo"))  # without create_local
    (SCRATCH_ROOT / legacy.sandbox_id / "owner.pid").write_text(dead)
    assert {box.sandbox_id, legacy.sandbox_id} <= set(sweep_stale())
    assert not data.exists() and not os.path.ismount(data / "ws") and not any(c.exists() for c in cgroups)
    assert not (SCRATCH_ROOT / box.sandbox_id).exists()  # its tmpfs unmounted too
    assert not (SCRATCH_ROOT / legacy.sandbox_id).exists() and (tmp_path / "repo").exists()
    box.cgroups = legacy.cgroups = None
    await box.close()
    await legacy.close()


@needs_bwrap
async def test_output_keeps_head_and_tail_and_counts_what_it_dropped() -> None:
    script = "echo FIRST; head -c 1000000 /dev/zero | tr '\\0' a; echo; echo LAST"
    _, done = await run_limited(Limits(output_bytes=64 << 10), script)
    assert done.failure_kind == "output_truncated" and done.exit_code == 0
    assert done.stdout.startswith("FIRST\n") and done.stdout.endswith("LAST\n")
    assert done.output_dropped == len("FIRST\n") + 1_000_000 + len("\nLAST\n") - (64 << 10)
    assert f"[... {done.output_dropped} bytes dropped ...]" in done.stdout


@needs_bwrap
async def test_cgroups_are_removed_at_close() -> None:
    box = await create_local(SandboxSpec(image=EXAMPLE_REPO))
    assert box.cgroups is not None
    dirs = list(box.cgroups.dirs.values())
    assert all(d.is_dir() for d in dirs)
    await box.close()
    assert not any(d.exists() for d in dirs)


def test_bounded_output_is_exact_at_every_split() -> None:
    data = bytes(range(256)) * 40
    for limit in (1, 2, 10, 255, 1000, 20_000):
        for step in (1, 7, 100, 4096):
            sink = BoundedOutput(limit)
            for i in range(0, len(data), step):
                sink.add(data[i : i + step])
            half = max(limit // 2, 1)
            kept = len(data) if len(data) <= 2 * half else 2 * half
            assert bytes(sink.head) == data[:half]
            assert len(sink.head) + len(sink.tail) == kept and sink.dropped == len(data) - kept
            assert bytes(sink.tail) == data[len(data) - len(sink.tail) :]


@given(st.binary(max_size=600), st.integers(0, 700), st.integers(1, 64))
def test_capped_bytes_keep_exactly_the_first_limit_bytes_and_know_of_more(
    data: bytes, limit: int, step: int
) -> None:
    sink = CappedBytes(limit)
    for i in range(0, len(data), step):
        sink.add(data[i : i + step])
    assert bytes(sink.data) == data[:limit] and sink.overflowed == (len(data) > limit)


@needs_bwrap
async def test_a_stream_past_its_cap_stops_the_command_and_the_host_keeps_the_cap() -> None:
    """``run_tool`` with a :class:`CappedBytes`: a command printing forever is killed one byte past the cap
    (it would never end on its own), and what came back is exactly the cap's worth of its output."""
    async with await create_local(SandboxSpec(image=EXAMPLE_REPO)) as box:
        sink = CappedBytes(100_000)
        done = await box.run_tool(["sh", "-c", "yes rollbus"], ENV, stdout=sink, timeout=60)
    assert sink.overflowed and bytes(sink.data) == b"rollbus\n" * 12_500
    assert not done.timed_out and done.failure_kind == "output_truncated" and done.exit_code != 0


def test_cgroup_v2_files_are_written_and_counters_read(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids io\n")
    group = Cgroups.create("rollbus-x", Limits(memory_bytes=MIB, pids=7, cpus=1.5), root=tmp_path)
    assert group is not None and group.version == 2
    path = tmp_path / "rollbus-x"
    assert (path / "memory.max").read_text() == str(MIB) and (path / "pids.max").read_text() == "7"
    assert (path / "cpu.max").read_text() == "150000 100000"
    assert group.procs_files() == [str(path / "cgroup.procs")]
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    (path / "pids.events").write_text("max 0\n")
    assert failure_from_counters({"oom_kill": 0, "pids_max": 0}, group.counters()) == "memory_limit"
    group.destroy()


def test_without_cgroups_rlimits_stand_in(tmp_path: Path) -> None:
    limits = Limits(memory_bytes=MIB, pids=5, cpu_time_s=3)
    assert Cgroups.create("x", limits, root=tmp_path / "none") is None
    assert {which for which, _ in rlimits(limits, None)} == {
        __import__("resource").RLIMIT_AS,
        __import__("resource").RLIMIT_NPROC,
        __import__("resource").RLIMIT_CPU,
    }
    report = enforcement(limits, None, "du")
    assert report["memory"].startswith("rlimit") and report["pids"].startswith("rlimit")
    assert os.getuid() == 0 or report  # the report exists whoever runs it


def test_the_start_up_report_names_every_boundary_as_a_sandbox_would_have_it() -> None:
    from rollbus.sandbox import probe_enforcement

    report = probe_enforcement(Limits())
    assert {"memory", "pids", "cpu", "disk", "nested_userns", "identity", "network"} <= set(report)
    assert report["network"].startswith("own namespace")
    if os.geteuid() == 0:  # what an agent sandbox made here reports
        assert report["disk"] == "tmpfs size (workspace and HOME)"
        assert report["network"] == "own namespace, the adapter proxy listens inside"
