"""The repository an agent works on, and its patch against the baseline.

The agent can rewrite anything under its workspace, including ``.git/config`` (hooks, ``core.fsmonitor``,
diff drivers and clean filters all run commands). So the baseline the patch is computed against lives in a
*trusted* git directory beside the workspace, never mounted into the sandbox, and every host-side git call
ignores user and system config. The workspace still gets its own ``.git`` for the agent to use.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

GIT_IDENTITY = ("-c", "user.name=rollbus", "-c", "user.email=rollbus@localhost", "-c", "commit.gpgsign=false")
BASELINE_MESSAGE = "rollbus baseline"
BASELINE_HEAD = "rollbus-head"  # the baseline commit's id, in the baseline git dir


class GitError(RuntimeError):
    """A host-side git command failed."""


def baseline_gitdir(workdir: Path) -> Path:
    """Where the trusted baseline of ``workdir`` lives (a sibling, outside anything mounted in a sandbox)."""
    workdir = Path(workdir).resolve()
    return workdir.with_name(workdir.name + ".baseline.git")


def prepare_repo(src_dir: Path, dest: Path) -> Path:
    """Copy ``src_dir`` to ``dest``, make it a git repository if it is not, record the trusted baseline.

    The baseline lands beside ``dest`` (:func:`baseline_gitdir`), so ``dest`` belongs in a scratch directory
    that the caller removes as a whole.
    """
    dest = Path(dest)
    shutil.copytree(src_dir, dest, symlinks=True)
    if not (dest / ".git").exists():
        _git(["init", "-q"], cwd=dest)
        _git(["add", "-A"], cwd=dest)
        _git([*GIT_IDENTITY, "commit", "-q", "--allow-empty", "-m", BASELINE_MESSAGE], cwd=dest)
    return record_baseline(dest)


def record_baseline(dest: Path) -> Path:
    """Record ``dest``'s files as the trusted baseline (beside it, see :func:`baseline_gitdir`)."""
    _trusted_git(dest, ["init", "-q", "--template="])  # no sample hooks: hooks never run here anyway
    _trusted_git(dest, ["add", "-A"])
    _trusted_git(dest, [*GIT_IDENTITY, "commit", "-q", "--allow-empty", "-m", BASELINE_MESSAGE])
    return dest


def pack_baseline(template: Path) -> Path:
    """Make ``template``'s baseline shareable (done once): its objects in one pack, so sharing it is a link
    or two, and its commit's id written down for :func:`share_baseline`."""
    _trusted_git(template, ["repack", "-a", "-d", "-q"])
    head = _trusted_git(template, ["rev-parse", "--verify", "HEAD"]).strip()
    (baseline_gitdir(template) / BASELINE_HEAD).write_text(head + "\n")
    return template


def share_baseline(template: Path, dest: Path) -> Path:
    """Give ``dest`` a baseline of its own that starts as ``template``'s (both hold the same files).

    A few small files: its own ``HEAD`` (the baseline commit, detached), its own copy of the index, and the
    template's pack (:func:`pack_baseline`) hard-linked, or copied across filesystems. git never rewrites a
    pack, and writes every object it makes (the agent's patch) as a new file of ``dest``'s own; removing the
    template later does not touch ``dest``. Both baselines live on the host only, out of every sandbox's
    reach (no sandbox can write either, so the link is never a way between them).
    """
    source, gitdir = baseline_gitdir(template), baseline_gitdir(dest)
    packs = list((source / "objects" / "pack").iterdir())
    if not packs or not (source / BASELINE_HEAD).exists():
        raise GitError(f"{source} was not made shareable (pack_baseline)")
    head = (source / BASELINE_HEAD).read_text()
    (gitdir / "objects" / "pack").mkdir(parents=True)
    (gitdir / "refs").mkdir()
    for pack in packs:
        try:
            os.link(pack, gitdir / "objects" / "pack" / pack.name)
        except OSError:
            shutil.copy2(pack, gitdir / "objects" / "pack" / pack.name)
    (gitdir / "HEAD").write_text(head)
    shutil.copyfile(source / "index", gitdir / "index")
    return dest


def git_diff(workdir: Path) -> str:
    """Every change under ``workdir`` since the baseline, new and binary files included, as text, by git on
    the host: for trees the host trusts (tests, tools). An agent's patch is taken inside its sandbox, as
    bytes under a cap (:func:`rollbus.sandbox.capture.capture_patch`)."""
    _trusted_git(workdir, ["add", "-A"])
    return _trusted_git(workdir, ["diff", "--cached", "--binary", "--no-ext-diff", "--no-textconv", "HEAD"])


def apply_patch(workdir: Path, patch: bytes | str) -> bool:
    """Apply ``patch`` (git's bytes, or text) to ``workdir``, all or nothing; False if it does not apply."""
    data = patch.encode() if isinstance(patch, str) else patch
    if not data.strip():
        return True
    done = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"],
        input=data,
        cwd=workdir,
        env=_git_env(),
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def _trusted_git(workdir: Path, args: list[str]) -> str:
    workdir = Path(workdir).resolve()
    gitdir = ["--git-dir", str(baseline_gitdir(workdir)), "--work-tree", str(workdir)]
    return _git([*gitdir, "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", *args], cwd=workdir)


def _git(args: list[str], *, cwd: Path) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, env=_git_env(), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise GitError(f"git {' '.join(args)} failed in {cwd}: {done.stderr.strip()}")
    return done.stdout


def _git_env() -> dict[str, str]:
    """No user/system config (deterministic, and nothing configured can run), no prompts, no pager."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
    return {
        **keep,
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_PAGER": "cat",
        # Sandbox workspaces belong to the sandbox's host uid; host-side git (as root) must still read them.
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "safe.directory",
        "GIT_CONFIG_VALUE_0": "*",
    }
