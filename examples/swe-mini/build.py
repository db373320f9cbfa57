"""Build the swe-mini images (git repositories) from the plain files under ``tasks/``, and the dataset rows.

Git repositories cannot live inside our own repository, so each task is stored as plain files and this script
makes its image: ``images/<id>/`` (ignored by git), a repository whose ``main`` branch holds the base commit
(``repo/``). swepro tasks also get a ``fix`` branch one commit ahead, holding the reference fix and the target
tests (``fix/``), as SWE-bench Pro images hold the fix commit the grader restores tests from. Commits use a
fixed identity and date, so their hashes are the same on every machine and ``tasks.jsonl`` can name them.

    python3 examples/swe-mini/build.py                 # build missing images, check tasks.jsonl matches
    python3 examples/swe-mini/build.py --write-tasks   # also rewrite tasks.jsonl and every gold.patch

Row paths (``image``, ``eval_files`` sources, swepro scripts) are relative to the dataset file. Eval-only
material (``hidden/``, ``fix/``, ``swepro/``, ``gold.patch``) must never reach an agent's sandbox.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASKS = HERE / "tasks"
IMAGES = HERE / "images"
DATASET = HERE / "tasks.jsonl"
WORKDIR = "/workspace"
COMMIT_ENV = {
    "GIT_AUTHOR_NAME": "swe-mini",
    "GIT_AUTHOR_EMAIL": "swe-mini@localhost",
    "GIT_COMMITTER_NAME": "swe-mini",
    "GIT_COMMITTER_EMAIL": "swe-mini@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "HOME": "/nonexistent",
}


def specs() -> list[dict[str, Any]]:
    """Every task's ``task.json``, with its directory name as ``id``, in a stable order."""
    return [{"id": d.name, **json.loads((d / "task.json").read_text())} for d in sorted(TASKS.iterdir())]


def git(repo: Path, *args: str, strip: bool = True) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **COMMIT_ENV}
    done = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo}: {done.stderr.strip()}")
    return done.stdout.strip() if strip else done.stdout


def copy_files(src: Path, dest: Path) -> None:
    """Copy the plain files of ``src`` over ``dest``, as mode 0644 (hashes must not depend on umask)."""
    for path in sorted(src.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
            target.chmod(0o644)


def apply_edit(repo: Path, edit: dict[str, str]) -> None:
    target = repo / edit["path"]
    text = target.read_text()
    if text.count(edit["old_string"]) != 1:
        raise RuntimeError(f"fix_edit old_string is not unique in {target}")
    target.write_text(text.replace(edit["old_string"], edit["new_string"]))


STAMP = "rollbus-build-stamp"  # in the image's .git: what it was built from (outside every commit)


def source_stamp(spec: dict[str, Any]) -> str:
    """What an image is made of: the task's spec and the files of its ``repo/`` and ``fix/``, and this
    script's recipe (``build_image`` and the commit identity)."""
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    digest.update(json.dumps(COMMIT_ENV, sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    for part in ("repo", "fix"):
        for path in sorted((TASKS / spec["id"] / part).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(str(path.relative_to(TASKS)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_image(spec: dict[str, Any], dest: Path) -> dict[str, str]:
    """Make ``dest`` the task's image, unless it was made from the same sources already (another process
    may be reading it: an image is rebuilt only when what it is made of changed); returns its commits
    (``base``, and ``fix`` for swepro tasks)."""
    task_dir = TASKS / spec["id"]
    stamp = source_stamp(spec)
    marker = dest / ".git" / STAMP
    if marker.is_file() and marker.read_text() == stamp:
        commits = {"base": git(dest, "rev-parse", "main")}
        if spec["grader"] == "swepro":
            commits["fix"] = git(dest, "rev-parse", "fix")
        return commits
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    copy_files(task_dir / "repo", dest)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", f"{spec['id']}: base")
    commits = {"base": git(dest, "rev-parse", "HEAD")}
    if spec["grader"] == "swepro":
        git(dest, "checkout", "-q", "-b", "fix")
        apply_edit(dest, spec["fix_edit"])
        copy_files(task_dir / "fix", dest)
        git(dest, "add", "-A")
        git(dest, "commit", "-q", "-m", f"{spec['id']}: fix")
        commits["fix"] = git(dest, "rev-parse", "HEAD")
        git(dest, "checkout", "-q", "main")
    marker.write_text(stamp)
    return commits


def gold_patch(spec: dict[str, Any], edit: str = "fix_edit") -> str:
    """The reference fix (or, with ``edit="probe_edit"``, the statement-only probe) as ``git diff`` prints it
    (source only; tests stay the grader's)."""
    with tempfile.TemporaryDirectory(prefix="swe-mini-gold-") as tmp:
        repo = Path(tmp)
        copy_files(TASKS / spec["id"] / "repo", repo)
        git(repo, "init", "-q")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", "base")
        apply_edit(repo, spec[edit])
        return git(repo, "diff", strip=False)  # a hunk may end on blank context lines


def grader_fields(spec: dict[str, Any], commits: dict[str, str]) -> dict[str, Any]:
    """The row's one grader, in slime's keys (swepro optionally in SWE-bench Pro's string-literal form)."""
    if spec["grader"] == "eval_cmd":
        return {"eval_cmd": spec["eval_cmd"]}
    if spec["grader"] == "f2p_script":
        return {"remote_env_info": {"f2p_script": spec["f2p_script"]}}
    files = spec["fix_files"]
    before = "\n".join([
        f"git reset --hard {commits['base']}",
        "git clean -fd",
        f"git checkout {commits['base']}",
        f"git checkout {commits['fix']} -- {' '.join(files)}",
    ])  # fmt: skip
    swepro: dict[str, Any] = {
        "run_script_path": "swepro/run_script.sh",
        "parser_script_path": "swepro/parser.py",
        "before_repo_set_cmd": before,
    }
    tests = {k: spec[k] for k in ("selected_test_files", "fail_to_pass", "pass_to_pass")}
    if spec.get("upstream_format"):  # SWE-bench Pro's own field name, and lists as Python literals
        swepro["selected_test_files_to_run"] = repr(tests.pop("selected_test_files"))
        tests = {k: repr(v) for k, v in tests.items()}
    return {"swepro": {**swepro, **tests}}


def row(spec: dict[str, Any], commits: dict[str, str]) -> dict[str, Any]:
    task_dir = f"tasks/{spec['id']}"
    metadata: dict[str, Any] = {
        "instance_id": spec["instance_id"],
        "image": f"images/{spec['id']}",
        "workdir": WORKDIR,
        "problem_statement": spec["problem_statement"],
    }
    if spec["eval_files"]:
        metadata["eval_files"] = {dest: f"{task_dir}/hidden/{dest}" for dest in spec["eval_files"]}
    metadata.update(grader_fields(spec, commits))
    probe = TASKS / spec["id"] / "probe.patch"
    if probe.is_file():  # only the statement's examples hard-coded: ``rollbus validate`` grades it
        metadata["statement_probe"] = probe.read_text()
    label = (TASKS / spec["id"] / "gold.patch").read_text()
    return {"prompt": spec["problem_statement"], "label": label, "metadata": metadata}


def build(
    images: Path = IMAGES, *, write_tasks: bool = False, dataset: Path = DATASET
) -> list[dict[str, Any]]:
    """Build every image under ``images`` and return the rows; checks (or rewrites) ``dataset``. One
    builder at a time per ``images`` (a lock file): processes side by side never see a half-made image."""
    rows = []
    images.mkdir(parents=True, exist_ok=True)
    with open(images / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for spec in specs():
            if write_tasks:
                (TASKS / spec["id"] / "gold.patch").write_text(gold_patch(spec))
                if "probe_edit" in spec:
                    (TASKS / spec["id"] / "probe.patch").write_text(gold_patch(spec, "probe_edit"))
            rows.append(row(spec, build_image(spec, images / spec["id"])))
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    if write_tasks:
        dataset.write_text(text)
    elif not dataset.exists() or dataset.read_text() != text:
        raise RuntimeError(f"{dataset} does not match the task files: run {__file__} --write-tasks")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=Path, default=IMAGES, help="where to build the image repositories")
    parser.add_argument("--write-tasks", action="store_true", help="rewrite tasks.jsonl and gold patches")
    args = parser.parse_args(argv)
    rows = build(args.images, write_tasks=args.write_tasks)
    print(f"{len(rows)} images in {args.images}; dataset {DATASET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
