"""Limits that hold while the bytes are written: the host's memory and disk stay within the caps while a
sandbox tries to exceed them, and every hit is named.

Each attack is what a policy would write: big random files in the workspace before its patch is taken, a
non-UTF-8 byte in a changed file, ``fallocate`` past the grader's disk, a filled ``/tmp`` with stderr
silenced. The host is measured around each attack: the test process's peak RSS (``VmHWM``, reset just
before; this process is the runner taking the patch) and the free space of the filesystem the sandboxes'
scratch lives on: a private one per test (:func:`host_disk`), so only what the attack leaks moves it, not
what other tests on the machine write meanwhile. Real bwrap sandboxes and cgroups, as root.
"""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest

from rollbus import codec
from rollbus.codec import HEADER, MAGIC
from rollbus.events import EVENT_TYPES, DiffEvent
from rollbus.grading import parse_row
from rollbus.grading.backends import grade_function
from rollbus.sandbox import BwrapSandbox, Limits, SandboxSpec, bwrap_usable, create_local
from rollbus.sandbox.bwrap_host import mount_tmpfs, unmount
from rollbus.sandbox.capture import capture_patch
from rollbus.sandbox.scratch import capped_scratch
from rollbus.services.grader.core import diff_patch
from rollbus.services.grader.settings import GradingOptions
from rollbus.services.sandbox_runner.outcome import AttemptResult, diff_event
from rollbus.services.sandbox_runner.rollout import attempt_outcome

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_REPO = ROOT / "examples" / "buggy_repo"
SWE_MINI = ROOT / "examples" / "swe-mini"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
MIB = 1 << 20
CAP = 1 * MIB  # the patch cap of these tests
RSS_SLACK = 48 * MIB  # what the runner may add to its peak beyond the cap (buffers, the interpreter's own)
DISK_SLACK = 16 * MIB  # host disk the attack may cost (nothing but metadata should reach it)
HOST_DISK = 1024 * MIB  # the private filesystem standing for the host's disk
needs_root_bwrap = pytest.mark.skipif(
    not bwrap_usable() or os.geteuid() != 0, reason="needs bubblewrap and root (cgroups, tmpfs mounts)"
)


@pytest.fixture
def host_disk() -> Iterator[Path]:
    """A filesystem nothing else writes to, standing for the host disk the sandboxes' scratch lives on: its
    free space moves by what the sandbox under test leaks past its caps and nothing else (the machine's
    shared disk once lost 91 MiB under a capture that wrote nothing there: other tests' files)."""
    path = Path(tempfile.mkdtemp(prefix="rollbus-host-disk-"))
    assert mount_tmpfs(path, 0o755, HOST_DISK, name="rollbus-host-disk"), "as root a tmpfs mounts"
    try:
        yield path
    finally:
        unmount(path)
        path.rmdir()


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class PeakRss:
    """This process's peak resident set (VmHWM), from a reset point: what the runner held at most."""

    def __enter__(self) -> PeakRss:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        self.start = self.read()
        self.grown = 0
        return self

    def __exit__(self, *_: object) -> None:
        self.grown = self.read() - self.start

    @staticmethod
    def read() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM in /proc/self/status")


async def agent_sandbox(limits: Limits, scratch_root: Path | None = None) -> BwrapSandbox:
    spec = SandboxSpec(image=EXAMPLE_REPO, limits=limits)
    return await (
        create_local(spec) if scratch_root is None else create_local(spec, scratch_root=scratch_root)
    )


# --- 14: taking the patch ------------------------------------------------------------------------------


@needs_root_bwrap
async def test_a_workspace_of_random_data_costs_the_runner_at_most_the_cap(host_disk: Path) -> None:
    """100 MB of random bytes in new files: the patch would be ~135 MB of base85. git runs in the sandbox
    (its cgroup pays), its output stops at the cap, and the runner's peak RSS and the host disk do not move
    by more than the cap and slack. (The host-side capture before took the whole diff into memory as text
    and wrote every new file into the baseline's objects on the host disk.)"""
    async with await agent_sandbox(Limits(memory_bytes=1024 * MIB, disk_bytes=512 * MIB), host_disk) as box:
        attack = "head -c 60M /dev/urandom > data.bin && head -c 40M /dev/urandom > more.bin"
        done = await box.run(["sh", "-c", attack], ENV, timeout=120)
        assert done.exit_code == 0 and done.failure_kind is None, done
        disk_before = free_bytes(host_disk)
        with PeakRss() as rss:
            captured = await capture_patch(box, CAP + 1, timeout=120)
        disk_drop = disk_before - free_bytes(host_disk)
    outcome = attempt_outcome("att-1", done, captured, CAP)
    assert (outcome.failure_kind, outcome.patch_truncated) == ("patch_too_large", True), captured
    assert len(outcome.patch) <= CAP and outcome.patch.startswith(b"diff --git a/data.bin b/data.bin\n")
    assert rss.grown < CAP + RSS_SLACK, f"the runner's peak RSS grew by {rss.grown >> 20} MiB"
    assert disk_drop < DISK_SLACK, f"the host disk lost {disk_drop >> 20} MiB"


@needs_root_bwrap
async def test_a_capture_that_outgrows_the_sandboxs_memory_is_named_and_keeps_nothing() -> None:
    """The same attack under a memory cap that holds the files but not git diffing them: git is killed by the
    sandbox's cgroup, never the runner; the attempt is ``patch_failed`` with ``memory_limit`` in its error."""
    async with await agent_sandbox(Limits(memory_bytes=160 * MIB, disk_bytes=512 * MIB)) as box:
        done = await box.run(["sh", "-c", "head -c 100M /dev/urandom > data.bin"], ENV, timeout=120)
        assert done.exit_code == 0 and done.failure_kind is None, done
        with PeakRss() as rss:
            captured = await capture_patch(box, 200 * MIB, timeout=120)  # a cap git cannot reach first
    assert captured.failure == "memory_limit", captured
    outcome = attempt_outcome("att-1", done, captured, 200 * MIB)
    assert (outcome.failure_kind, outcome.patch) == ("patch_failed", b"")
    assert "memory_limit" in (outcome.error or "")
    assert rss.grown < RSS_SLACK + len(captured.patch), f"the runner's peak RSS grew by {rss.grown >> 20} MiB"


@needs_root_bwrap
async def test_the_agents_git_config_and_hooks_do_not_run_in_the_capture(tmp_path: Path) -> None:
    """The workspace's ``.git`` and attributes are the agent's: a diff driver, fsmonitor or hook it planted
    never runs (nothing of the capture reads them), and its excluded paths stay out of the patch."""
    marker = "/workspace/.pwned"
    async with await agent_sandbox(Limits()) as box:
        plant = (
            "git init -q . 2>/dev/null; git config core.fsmonitor 'touch " + marker + "';"
            "git config diff.evil.command 'touch " + marker + "';"
            "echo '* diff=evil' > .gitattributes; echo changed >> calc.py;"
            "mkdir -p .claude; echo s > .claude/x"
        )
        done = await box.run(["sh", "-c", plant], ENV)
        assert done.exit_code == 0, done
        captured = await capture_patch(box, CAP, excluded=[".claude"])
        assert captured.failure is None and not captured.truncated, captured
        assert not (box.host_workdir / ".pwned").exists()
    assert b"+changed\n" in captured.patch and b".claude" not in captured.patch


@needs_root_bwrap
async def test_half_a_million_files_cost_the_runner_no_set_of_them() -> None:
    """After each command the host walks the workspace (setuid bits stripped, usage counted) remembering only
    hard-linked files: 500k empty files cost the runner's peak RSS the walk's own listing, not a set entry per
    file (before: +97 MiB here; now about a third of that)."""
    async with await agent_sandbox(Limits(memory_bytes=2048 * MIB, disk_bytes=2048 * MIB)) as box:
        spray = "import os\nfor i in range(500_000):\n    os.close(os.open(f'f{i:07d}', os.O_CREAT))"
        with PeakRss() as rss:
            done = await box.run(["python3", "-c", spray], ENV, timeout=600)
    assert done.exit_code == 0 and done.failure_kind is None, done
    assert rss.grown < 64 * MIB, f"the runner's peak RSS grew by {rss.grown >> 20} MiB"


# --- 15: the patch is bytes ----------------------------------------------------------------------------


@needs_root_bwrap
async def test_a_latin1_edit_reaches_the_grader_byte_for_byte(tmp_path: Path) -> None:
    """One non-UTF-8 byte in a changed file: the patch carries it (the whole patch, nothing lost), the diff
    event holds it as Avro bytes, the grader receives those bytes, and ``git apply`` of them rebuilds the
    agent's file exactly. (Before, the host decoded git's output as UTF-8: ``runner_error``, no patch.)"""
    async with await agent_sandbox(Limits()) as box:
        edit = "printf '# caf\\351 cr\\350me\\n' >> calc.py && printf 'ol\\341\\n' > new_latin1.txt"
        done = await box.run(["sh", "-c", edit], ENV)
        assert done.exit_code == 0, done
        captured = await capture_patch(box, CAP)
        wanted = [(box.host_workdir / name).read_bytes() for name in ("calc.py", "new_latin1.txt")]
    outcome = attempt_outcome("att-1", done, captured, CAP)
    assert outcome.failure_kind is None and b"+# caf\xe9 cr\xe8me\n" in outcome.patch
    event = diff_event({"rollout_id": "r-1"}, AttemptResult("att-1", outcome.patch), now_ms=1)
    received = diff_patch(codec.decode(codec.encode("diff", event)).event_as(DiffEvent))
    assert received == outcome.patch
    fresh = tmp_path / "fresh"
    subprocess.run(["cp", "-r", str(EXAMPLE_REPO), str(fresh)], check=True)
    subprocess.run(["git", "apply", "-"], input=received, cwd=fresh, check=True)
    assert [(fresh / name).read_bytes() for name in ("calc.py", "new_latin1.txt")] == wanted


def test_a_diff_written_before_v3_reads_back_as_its_utf8_bytes() -> None:
    """v1/v2 wrote the patch as an Avro string: read under v3 it is that string's UTF-8 bytes."""
    record = {
        "schema_version": 2, "rollout_id": "r-1", "patch": "+café\n", "exit_status": 0, "wall_time_s": 1.0,
        "turns": 1, "error": None, "at": 1,
    }  # fmt: skip
    buffer = io.BytesIO()
    buffer.write(HEADER.pack(MAGIC, EVENT_TYPES.index("diff"), 2))
    fastavro.schemaless_writer(buffer, fastavro.parse_schema(codec.schema("diff", 2)), record)
    decoded = codec.decode(buffer.getvalue())
    assert decoded.schema_version == 2 and decoded.record["patch"] == "+café\n".encode()
    assert diff_patch(decoded.event_as(DiffEvent)) == "+café\n".encode()


# --- 16: the grader's disk -----------------------------------------------------------------------------


@needs_root_bwrap
async def test_fallocate_past_the_graders_disk_never_reaches_the_host_disk(host_disk: Path) -> None:
    """Code under test in the grader's repository allocates 6 GB, then writes zeros until the disk is full,
    stderr silenced. The repository sits on a capped tmpfs: both fail while they write, the host disk does
    not move (measured before the scratch is removed), and the sandbox names the hit ``disk_full``."""
    before = free_bytes(host_disk)
    with capped_scratch("rollbus-grade-test-", host_disk, size=32 * MIB) as scratch:
        repo = scratch / "repo"
        subprocess.run(["cp", "-r", str(EXAMPLE_REPO), str(repo)], check=True)
        box = await BwrapSandbox.create(repo, network="none")
        try:
            attack = "exec 2>/dev/null; fallocate -l 6G big; head -c 6G /dev/zero > fill; exit 0"
            done = await box.run(["sh", "-c", attack], ENV, timeout=120)
        finally:
            await box.close()
        drop = before - free_bytes(host_disk)
        held = sum(p.stat().st_blocks * 512 for p in repo.iterdir() if p.is_file())
    assert done.exit_code == 0 and done.failure_kind == "disk_full", done
    assert drop < DISK_SLACK, f"the host disk lost {drop >> 20} MiB"
    assert held <= 32 * MIB


@needs_root_bwrap
@pytest.mark.parametrize("backend", ["local", pytest.param("docker", marks=pytest.mark.docker)])
async def test_a_patch_that_fills_the_graders_disk_scores_zero_named_disk_full(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through ``grade``: the gold fix plus code in the fixed module that, at import, allocates 6 GB and then
    writes zeros until the disk is full, errors swallowed. Reward 0, failure kind ``disk_full``; the gold
    fix alone on the same capped scratch still scores 1 (the cap is roomy for honest work). In containers
    the cap is the engine's, not the grader's scratch mount (which a grader beside the engine, under Compose,
    could not give it): the test sandbox's tree is a tmpfs volume of the scratch's size that the engine made,
    the bytes went there, and the host tree behind it got none of them."""
    row = next(r for r in load_build().build() if r["metadata"]["image"].endswith("/sum-to"))
    config = GradingOptions(scratch_bytes=48 * MIB).grade_config()  # what --scratch-bytes sets
    spec = parse_row(row, SWE_MINI)
    grade = grade_function(backend)
    seen: list[dict[str, Any]] = []
    if backend == "docker":
        from rollbus.grading.container import GradingContainer

        close = GradingContainer.close

        async def looked_at(self: GradingContainer) -> None:  # the test sandbox, as it closes
            if self.tree_copied:
                box = self.box
                mounts = box.client.api.inspect_container(box._work_id)["Mounts"]
                volume = next(m["Name"] for m in mounts if m["Destination"] == box.workdir)
                filled = await box.run(["sh", "-c", "cat fill big 2>/dev/null | wc -c"], ENV)
                host = box.host_workdir
                seen.append({
                    "options": box.client.api.inspect_volume(volume)["Options"],
                    "inside": int(filled.stdout.strip() or 0),
                    "on_host": [p.name for p in (host / "fill", host / "big") if p.exists()],
                })  # fmt: skip
            await close(self)

        monkeypatch.setattr(GradingContainer, "close", looked_at)
    gold = await grade(spec, row["label"], config)
    assert (gold.reward, gold.failure_kind) == (1.0, None), gold
    fill = (
        "\n\ntry:\n"
        "    import os as _os\n"
        "    _os.posix_fallocate(_os.open('big', _os.O_CREAT | _os.O_WRONLY), 0, 6 << 30)\n"
        "except OSError:\n"
        "    try:\n"
        "        with open('fill', 'wb') as _f:\n"
        "            _f.write(bytes(96 << 20))\n"
        "    except OSError:\n"
        "        pass\n"
    )
    image = SWE_MINI / row["metadata"]["image"]
    attack = patch_of(image, tmp_path / "repo", row["label"], "calc/core.py", fill)
    seen.clear()
    filled = await grade(spec, attack, config)
    assert (filled.reward, filled.failure_kind) == (0.0, "disk_full"), filled
    if backend == "docker":
        [tests] = seen
        assert tests["options"]["type"] == "tmpfs", tests
        assert f"size={48 * MIB}" in tests["options"]["o"].split(","), tests
        assert 40 * MIB < tests["inside"] <= 48 * MIB and tests["on_host"] == [], tests


def load_build() -> Any:
    spec = importlib.util.spec_from_file_location("swe_mini_build", SWE_MINI / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patch_of(image: Path, repo: Path, label: str, path: str, appended: str) -> str:
    """``label`` applied to a copy of ``image`` with ``appended`` at the end of ``path``, as one patch."""
    subprocess.run(["cp", "-r", str(image), str(repo)], check=True)
    git = ["git", "-c", "core.hooksPath=/dev/null"]
    subprocess.run([*git, "apply", "-"], input=label.encode(), cwd=repo, check=True)
    with (repo / path).open("a") as f:
        f.write(appended)
    return subprocess.run([*git, "diff"], cwd=repo, check=True, capture_output=True, text=True).stdout


# --- 17: a full /tmp ------------------------------------------------------------------------------------


@needs_root_bwrap
async def test_a_full_tmp_is_named_even_with_stderr_silenced() -> None:
    """The private /tmp is a tmpfs the host mounts: its fill is measured after the command, so an agent that
    hides ENOSPC (stderr to /dev/null, exit 0) still ends ``disk_full``; the next command finds /tmp empty."""
    async with await agent_sandbox(Limits(tmp_bytes=2 * MIB)) as box:
        attack = "exec 2>/dev/null; head -c 64M /dev/zero > /tmp/fill; exit 0"
        done = await box.run(["sh", "-c", attack], ENV)
        after = await box.run(["sh", "-c", "ls -A /tmp | wc -l; df -k /tmp | tail -1"], ENV)
    assert (done.exit_code, done.stderr, done.failure_kind) == (0, "", "disk_full"), done
    assert after.failure_kind is None and after.stdout.split()[0] == "0", after


@needs_root_bwrap
async def test_a_tmp_with_room_left_is_no_failure() -> None:
    async with await agent_sandbox(Limits(tmp_bytes=8 * MIB)) as box:
        done = await box.run(["sh", "-c", "head -c 1M /dev/zero > /tmp/some"], ENV)
    assert (done.exit_code, done.failure_kind) == (0, None), done
