"""Host-side repository helpers with real git: baseline, the agent's patch, applying it elsewhere."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rollbus.sandbox import apply_patch, baseline_gitdir, git_diff, prepare_repo

EXAMPLE_REPO = Path(__file__).resolve().parents[1] / "examples" / "buggy_repo"


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` except git metadata, as relative path -> bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def agent_edits(workdir: Path) -> None:
    calc = workdir / "calc.py"
    calc.write_text(calc.read_text().replace("range(1, n)", "range(1, n + 1)"))
    (workdir / "README.md").unlink()
    (workdir / "notes").mkdir()
    (workdir / "notes" / "new.txt").write_text("a new file\n")
    (workdir / "blob.bin").write_bytes(bytes(range(256)))


def test_prepared_repo_is_a_git_repo_with_an_empty_diff(tmp_path: Path) -> None:
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "repo")
    log = subprocess.run(["git", "log", "--oneline"], cwd=workdir, capture_output=True, text=True, check=True)
    assert len(log.stdout.splitlines()) == 1
    assert baseline_gitdir(workdir).is_dir() and not baseline_gitdir(workdir).is_relative_to(workdir)
    assert tree(workdir) == tree(EXAMPLE_REPO)
    assert git_diff(workdir) == ""


def test_diff_has_edits_deletions_new_and_binary_files(tmp_path: Path) -> None:
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "repo")
    agent_edits(workdir)
    patch = git_diff(workdir)
    assert "+    return sum(range(1, n + 1))" in patch
    assert "deleted file mode" in patch and "+++ b/notes/new.txt" in patch
    assert "GIT binary patch" in patch


def test_patch_reproduces_the_agents_tree_on_a_fresh_copy(tmp_path: Path) -> None:
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "agent")
    agent_edits(workdir)
    patch = git_diff(workdir)
    fresh = prepare_repo(EXAMPLE_REPO, tmp_path / "grader")
    assert apply_patch(fresh, patch)
    assert tree(fresh) == tree(workdir)


def test_a_patch_that_does_not_apply_changes_nothing(tmp_path: Path) -> None:
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "agent")
    agent_edits(workdir)
    patch = git_diff(workdir)
    before = tree(workdir)
    assert not apply_patch(workdir, patch)  # already applied: the first hunk's context no longer matches
    assert tree(workdir) == before
    assert apply_patch(workdir, "")


def test_agent_commits_and_git_config_cannot_hide_changes_or_run_commands(tmp_path: Path) -> None:
    workdir = prepare_repo(EXAMPLE_REPO, tmp_path / "repo")
    pwned = tmp_path / "pwned"
    (workdir / ".gitattributes").write_text("* filter=evil diff=evil\n")
    git = ["git", "-c", "user.name=a", "-c", "user.email=a@b"]
    for key, value in [
        ("core.fsmonitor", f"touch {pwned}; false"),
        ("filter.evil.clean", f"touch {pwned}; cat"),
        ("diff.evil.textconv", f"touch {pwned}; cat"),
        ("diff.external", f"touch {pwned}"),
    ]:
        subprocess.run(["git", "config", key, value], cwd=workdir, check=True)
    agent_edits(workdir)
    subprocess.run([*git, "commit", "-qam", "hide it"], cwd=workdir, check=True)
    pwned.unlink(missing_ok=True)  # the agent's own git calls may run its config; ours must not
    patch = git_diff(workdir)
    assert not pwned.exists()
    assert "+    return sum(range(1, n + 1))" in patch and "+++ b/.gitattributes" in patch


def test_an_existing_repository_keeps_its_history(tmp_path: Path) -> None:
    src = prepare_repo(EXAMPLE_REPO, tmp_path / "upstream")
    workdir = prepare_repo(src, tmp_path / "repo")
    head = ["git", "rev-parse", "HEAD"]
    upstream_head = subprocess.run(head, cwd=src, capture_output=True, text=True, check=True).stdout
    assert (
        subprocess.run(head, cwd=workdir, capture_output=True, text=True, check=True).stdout == upstream_head
    )
    assert git_diff(workdir) == ""
