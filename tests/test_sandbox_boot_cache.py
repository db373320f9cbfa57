"""The agent-workspace cache behind fast boots, attacked as a policy would: real bwrap, real git.

Each agent sandbox copies a cached, history-free workspace and gets a baseline that shares the cache
entry's one pack of objects (linked; git never rewrites a pack). What must hold: nothing a sandbox does (in
its workspace, in its own ``.git``, or through the host's diff of it) changes the entry or what the next
sandbox gets, and an image that changed in any way gets a new entry.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from rollbus.sandbox import SandboxSpec, bwrap_usable, create_local, git_diff

EXAMPLE_REPO = Path(__file__).resolve().parents[1] / "examples" / "buggy_repo"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/home/agent"}

pytestmark = pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")

# Everything an agent might do to its repository: edit, delete, add, commit, rewrite its own git objects.
VANDAL = (
    "set -e; echo 'BROKEN = 1' >> calc.py; rm test_calc.py; echo new > new.txt; chmod 700 README.md;"
    "git -c user.name=a -c user.email=a@a add -A; git -c user.name=a -c user.email=a@a commit -qm evil;"
    "for f in $(find .git/objects -type f); do chmod u+w $f; echo junk > $f; done; echo junk > .git/index"
)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    repo = tmp_path / "image"
    shutil.copytree(EXAMPLE_REPO, repo)
    return repo


def entries(scratch: Path) -> list[Path]:
    return sorted((scratch / "images").glob("agent-*"))


def digest(root: Path) -> str:
    """Every path, type, mode and byte under ``root`` (mtimes left out: git may touch an object's time)."""
    h = hashlib.sha256()
    for parent, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(parent, name)
            st = path.lstat()
            h.update(f"{path.relative_to(root)}\0{stat.filemode(st.st_mode)}\0".encode())
            if stat.S_ISREG(st.st_mode):
                h.update(path.read_bytes())
            elif stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
    return h.hexdigest()


async def pristine(box: object) -> str:
    """What a fresh sandbox's repository looks like from inside: files, one commit, a clean status."""
    done = await box.run(  # type: ignore[attr-defined]
        ["sh", "-c", "ls -A; git log --oneline | wc -l; git status --porcelain; md5sum calc.py"], ENV
    )
    assert done.exit_code == 0, done.stderr
    return done.stdout


async def test_a_sandbox_vandalising_its_repo_changes_neither_the_cache_nor_the_next_sandbox(
    image: Path, scratch: Path
) -> None:
    spec = SandboxSpec(image=image)
    async with await create_local(spec, scratch_root=scratch) as first:
        before = await pristine(first)
        [entry] = entries(scratch)
        cached = digest(entry)
        done = await first.run(["sh", "-c", VANDAL], ENV)
        assert done.exit_code == 0, done.stderr
        patch = git_diff(first.host_workdir)  # the host's diff writes the agent's objects somewhere
    assert "+BROKEN = 1" in patch and "deleted file mode" in patch and "+++ b/new.txt" in patch
    assert digest(entry) == cached  # ... never into the cache entry the baseline reads from
    async with await create_local(spec, scratch_root=scratch) as second:
        assert await pristine(second) == before
        assert git_diff(second.host_workdir) == ""
        assert "BROKEN" not in (second.host_workdir / "calc.py").read_text()
    assert entries(scratch) == [entry]  # the same entry served both


async def test_two_live_sandboxes_of_one_image_share_nothing_writable(image: Path, scratch: Path) -> None:
    spec = SandboxSpec(image=image)
    async with await create_local(spec, scratch_root=scratch) as first:
        async with await create_local(spec, scratch_root=scratch) as second:
            await first.run(["sh", "-c", VANDAL], ENV)
            for name in ("calc.py", "README.md", ".git/index", ".git/HEAD"):
                a, b = (box.host_workdir / name for box in (first, second))
                assert not os.path.samefile(a, b) and a.stat().st_nlink == 1
            assert "BROKEN" not in (second.host_workdir / "calc.py").read_text()
            assert git_diff(second.host_workdir) == ""
            assert "+BROKEN = 1" in git_diff(first.host_workdir)


@pytest.mark.parametrize("change", ["edit", "same_size_and_mtime", "add", "delete", "chmod"])
async def test_a_changed_image_gets_a_new_entry(image: Path, scratch: Path, change: str) -> None:
    spec = SandboxSpec(image=image)
    async with await create_local(spec, scratch_root=scratch) as box:
        await pristine(box)
    calc = image / "calc.py"
    if change == "edit":
        calc.write_text(calc.read_text() + "\nEDITED = 1\n")
    elif change == "same_size_and_mtime":  # a same-size rewrite with the old mtime put back
        st = calc.stat()
        text = calc.read_text()
        calc.write_text(text[:-2] + "#\n" if text.endswith("\n") else text[:-1] + "#")
        os.utime(calc, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert calc.stat().st_size == st.st_size and calc.stat().st_mtime_ns == st.st_mtime_ns
    elif change == "add":
        (image / "added.py").write_text("ADDED = 1\n")
    elif change == "delete":
        (image / "README.md").unlink()
    else:
        calc.chmod(0o755)
    async with await create_local(spec, scratch_root=scratch) as box:
        inside = await box.run(["sh", "-c", "ls -l; cat calc.py; git status --porcelain"], ENV)
        assert git_diff(box.host_workdir) == ""  # the baseline is the changed image too
        expected = {p.name: p.read_bytes() for p in image.iterdir() if p.is_file()}
        seen = {p.name: p.read_bytes() for p in box.host_workdir.iterdir() if p.is_file()}
        assert seen == expected, inside.stdout
        if change == "chmod":
            assert (box.host_workdir / "calc.py").stat().st_mode & 0o100
    assert len(entries(scratch)) == 2


async def test_sandboxes_booting_at_once_from_a_new_image_build_one_entry(image: Path, scratch: Path) -> None:
    spec = SandboxSpec(image=image)
    boxes = await asyncio.gather(*(create_local(spec, scratch_root=scratch) for _ in range(4)))
    try:
        outputs = [await pristine(box) for box in boxes]
        assert len(set(outputs)) == 1 and all(git_diff(box.host_workdir) == "" for box in boxes)
    finally:
        for box in boxes:
            await box.close()
    assert len(entries(scratch)) == 1
    assert [p.name for p in (scratch / "images").iterdir() if p.name.startswith(".")] == []  # no leftovers


async def test_the_cache_entry_is_out_of_every_sandboxs_reach(image: Path, scratch: Path) -> None:
    async with await create_local(SandboxSpec(image=image), scratch_root=scratch) as box:
        [entry] = entries(scratch)
        marker = "ROLLBUS_CACHE_MARKER_1234"
        (entry / "ws.baseline.git" / marker).write_text(marker)
        # By name everywhere (a bind of the entry keeps its names); by content everywhere but the host's
        # read-only /usr (gigabytes, and never where a scratch root lives) and the top-level links into it
        # (/lib -> usr/lib: grep follows a link named on its command line, which walked all of /usr/lib).
        done = await box.run(
            [
                "sh",
                "-c",
                "find / -path /proc -prune -o -path /sys -prune -o "
                f"-name {marker} -print 2>/dev/null | head -3; "
                "for top in /*; do case $top in /usr|/proc|/sys) ;; "
                f"*) [ -L $top ] || grep -rsl {marker} $top | head -3;; esac; done; "
                f"ls {entry} {scratch} 2>&1 | head -3",
            ],
            ENV,
            timeout=120,
        )
        (entry / "ws.baseline.git" / marker).unlink()
    assert not done.timed_out, done.wall_time_s
    assert marker not in done.stdout and "No such file or directory" in done.stdout


def test_git_objects_of_a_diff_land_in_the_sandboxs_own_store(tmp_path: Path) -> None:
    """The mechanism without a sandbox: the shared pack is read, never written, and outlives its entry."""
    from rollbus.sandbox.images import agent_workspace
    from rollbus.sandbox.repo import GitError, baseline_gitdir, pack_baseline, record_baseline, share_baseline

    unpacked = record_baseline(agent_workspace(EXAMPLE_REPO, tmp_path / "unpacked"))
    with pytest.raises(GitError):
        share_baseline(unpacked, tmp_path / "nowhere")
    template = pack_baseline(record_baseline(agent_workspace(EXAMPLE_REPO, tmp_path / "template")))
    before = digest(baseline_gitdir(template))
    work = tmp_path / "work"
    subprocess.run(["cp", "-a", f"{template}/.", str(work)], check=True)
    share_baseline(template, work)
    assert git_diff(work) == ""
    (work / "calc.py").write_text("CHANGED = 1\n")
    assert "+CHANGED = 1" in git_diff(work)
    assert digest(baseline_gitdir(template)) == before
    own = [p for p in (baseline_gitdir(work) / "objects").rglob("*") if p.is_file() and "pack" not in p.parts]
    assert len(own) == 1  # the changed file's new blob: a loose object of the sandbox's own
    shutil.rmtree(template.parent / "template.baseline.git")  # the cache entry removed under a live sandbox
    (work / "new.txt").write_text("n\n")
    patch = git_diff(work)
    assert "+CHANGED = 1" in patch and "+++ b/new.txt" in patch


def odd_tree(root: Path, extra_files: int = 0) -> Path:
    """Symlinks (relative, absolute, dangling, to a dir), an empty dir, a read-only dir, modes, old mtimes."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 64)
    (root / "link").symlink_to("pkg/mod.py")
    (root / "abs").symlink_to("/etc/hostname")
    (root / "dangling").symlink_to("nowhere")
    (root / "dirlink").symlink_to("pkg")
    for i in range(extra_files):
        (root / "pkg" / f"f{i}.txt").write_text(str(i))
    (root / "locked").mkdir()
    (root / "locked" / "inside.txt").write_text("in\n")
    for path in [*root.rglob("*"), root]:
        os.utime(path, ns=(1_000_000_000, 1_000_000_000), follow_symlinks=False)
    (root / "locked").chmod(0o555)
    return root


def full_digest(root: Path) -> str:
    """:func:`digest` plus every mtime (a copy keeps them, as ``cp -a`` does)."""
    stamps = sorted(
        f"{p.relative_to(root)}:{p.lstat().st_mtime_ns}" for p in root.rglob("*") if not p.is_symlink()
    )
    return digest(root) + "|".join(stamps)


@pytest.mark.parametrize("extra_files", [0, 600])  # in-process, and past SMALL_ENTRY (cp)
def test_copying_an_entry_equals_cp_a(tmp_path: Path, extra_files: int) -> None:
    from rollbus.sandbox.images import _plain_listing, copy_entry

    src = odd_tree(tmp_path / "src", extra_files)
    reference, copied = tmp_path / "reference", tmp_path / "copied"
    reference.mkdir()
    subprocess.run(["cp", "-a", *(str(p) for p in src.iterdir()), str(reference)], check=True)
    copy_entry(src, copied)
    st = src.stat()
    assert (_plain_listing(str(src), st.st_ino, st.st_ctime_ns) is None) == (extra_files > 0)
    assert full_digest(copied) == full_digest(reference)
    assert (copied / "link").is_symlink() and (copied / "dirlink").is_symlink()
    (copied / "pkg" / "mod.py").write_text("changed\n")
    assert (src / "pkg" / "mod.py").read_text() == "X = 1\n"  # a copy, not a link


def test_an_entry_with_a_fifo_is_copied_by_cp(tmp_path: Path) -> None:
    from rollbus.sandbox.images import copy_entry

    src = odd_tree(tmp_path / "src")
    (src / "pkg").chmod(0o755)
    os.mkfifo(src / "pkg" / "pipe")
    copy_entry(src, tmp_path / "copied")
    assert stat.S_ISFIFO((tmp_path / "copied" / "pkg" / "pipe").lstat().st_mode)


async def test_a_rewritten_tarball_image_gets_a_new_entry_and_an_unchanged_one_is_not_walked(
    tmp_path: Path, scratch: Path
) -> None:
    import tarfile

    from rollbus.sandbox import images

    image = tmp_path / "image.tar"

    def pack(extra: str) -> None:
        (tmp_path / "src").mkdir(exist_ok=True)
        shutil.copytree(EXAMPLE_REPO, tmp_path / "src" / "repo", dirs_exist_ok=True)
        (tmp_path / "src" / "repo" / "calc.py").write_text(f"# {extra}\n")
        with tarfile.open(image, "w") as tar:
            tar.add(tmp_path / "src" / "repo", arcname="repo")

    pack("first")
    spec = SandboxSpec(image=image)
    walked: list[Path] = []
    real_walk = images.tree_fingerprint
    images.tree_fingerprint = lambda root: walked.append(root) or real_walk(root)  # type: ignore[assignment]
    try:
        for _ in range(2):
            async with await create_local(spec, scratch_root=scratch) as box:
                assert (box.host_workdir / "calc.py").read_text() == "# first\n"
        st = image.stat()
        pack("secnd")  # rewritten in place: the same size, and the old mtime put back
        os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert image.stat().st_size == st.st_size
        async with await create_local(spec, scratch_root=scratch) as box:
            assert (box.host_workdir / "calc.py").read_text() == "# secnd\n"
            assert git_diff(box.host_workdir) == ""
    finally:
        images.tree_fingerprint = real_walk  # type: ignore[assignment]
    assert walked == [] and len(entries(scratch)) == 2
