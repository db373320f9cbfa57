"""Build the real upstream task from released sdists: its image, its eval-only test file, and its row.

The task is ``parse`` (https://pypi.org/project/parse/, one pure-Python module, no dependencies, its tests in
the sdist): release 1.20.1 does not recognise a hyphen in a field name (``{user-id}`` is not a field, so
``named_fields`` is empty and ``search`` finds nothing; upstream issue #86), and release 1.20.2 fixes it with
two new tests in ``tests/test_parse.py``. The image is 1.20.1's sdist as a git repository whose HEAD is the
base commit (as ``examples/swe-mini/build.py`` makes its images, with its fixed commit identity); the grader
copies 1.20.2's ``tests/test_parse.py`` in after the patch and runs the whole suite; the reference fix
(``label``) is the diff of the library code from 1.20.1 to 1.20.2, tests excluded.

    python3 examples/upstream/build.py                 # download (once) and build; check tasks.jsonl matches
    python3 examples/upstream/build.py --write-tasks   # also rewrite tasks.jsonl

The sdists are fetched with ``pip download`` into ``sdists/`` (kept there, checked against the hashes below);
``sdists/``, ``images/`` and ``eval/`` are ignored by git. Eval material must never reach an agent's sandbox.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SDISTS = HERE / "sdists"
IMAGES = HERE / "images"
EVAL = HERE / "eval"
DATASET = HERE / "tasks.jsonl"
WORKDIR = "/workspace"

PROJECT = "parse"
BASE = ("1.20.1", "09002ca350ad42e76629995f71f7b518670bcf93548bdde3684fd55d2be51975")  # version, sdist sha256
FIX = ("1.20.2", "b41d604d16503c79d81af5165155c0b20f6c8d6c559efa66b4b695c3e5a0a0ce")
LIBRARY = ("parse.py",)  # what the reference fix may change
HIDDEN_TEST = "tests/test_parse.py"  # from the fix release: holds the tests that show the bug
# the one test the suite skips on Python 3 (a pre-3.5 regex limit): deselected, so every test run passes
EVAL_CMD = (
    "python3 -m pytest -q -p no:cacheprovider tests --deselect tests/test_parse.py::test_too_many_fields"
)
INSTANCE_ID = "upstream__parse-hyphen-field-names"
PROBLEM = """\
Field names containing a hyphen are not recognised.

    >>> import parse
    >>> parse.Parser("/local/sub/{user-id}/duration").named_fields
    []
    >>> parse.search("/local/sub/{user-id}/duration", "https://x.com/local/sub/1647222638/duration")

returns None. A hyphenated name should work like any other field name: `named_fields` should list it under a
group name usable in a regular expression (`user_id`), and the result should be indexed by the name as
written (`result["user-id"] == "1647222638"`). Formats that use `{user-id}`, `{user_id}` and `{user.id}`
together must still give each field its own value.
"""


def swe_mini_build() -> Any:
    """examples/swe-mini/build.py, for its git helpers and commit identity (one way to make an image)."""
    spec = importlib.util.spec_from_file_location("swe_mini_build", HERE.parent / "swe-mini" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pip() -> list[str]:
    """A pip to download with: this interpreter's, else the one on PATH."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    found = shutil.which("pip3") or shutil.which("pip")
    if found is None:
        raise RuntimeError("no pip to download the sdists with (install pip, or put the sdists in sdists/)")
    return [found]


def sdist(version: str, sha256: str) -> Path:
    """The release's sdist, downloaded once into ``sdists/`` and checked against its hash."""
    path = SDISTS / f"{PROJECT}-{version}.tar.gz"
    if not path.exists():
        SDISTS.mkdir(parents=True, exist_ok=True)
        command = [*pip(), "download", "--no-deps", "--no-binary", ":all:", "--dest", str(SDISTS)]
        done = subprocess.run(
            [*command, f"{PROJECT}=={version}"], capture_output=True, text=True, check=False
        )
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(f"pip download {PROJECT}=={version} failed: {done.stderr.strip()[-2000:]}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise RuntimeError(f"{path} has sha256 {digest}, not the release's {sha256}: delete it and rebuild")
    return path


def unpack(archive: Path, dest: Path) -> Path:
    """The sdist's files under ``dest`` (its one top directory), build metadata (``*.egg-info``) left out."""
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    (top,) = dest.iterdir()
    for info in top.glob("*.egg-info"):
        shutil.rmtree(info)
    return top


def gold_patch(build: Any, base: Path, fix: Path) -> str:
    """The library code's diff from the base release to the fix release, as ``git diff`` prints it."""
    with tempfile.TemporaryDirectory(prefix="upstream-gold-") as tmp:
        repo = Path(tmp)
        build.copy_files(base, repo)
        build.git(repo, "init", "-q")
        build.git(repo, "add", "-A")
        build.git(repo, "commit", "-q", "-m", "base")
        for name in LIBRARY:
            (repo / name).write_bytes((fix / name).read_bytes())
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **build.COMMIT_ENV}
        # not build.git: it strips the output, and with it the blank context line that ends this diff
        return subprocess.run(
            ["git", "diff"], cwd=repo, env=env, capture_output=True, text=True, check=True
        ).stdout


def source_stamp(build: Any) -> str:
    """What the image is made of: both releases' hashes, the commit identity and this script's recipe."""
    digest = hashlib.sha256(json.dumps([BASE, FIX, build.COMMIT_ENV], sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def make_image(build: Any, base: Path, image: Path) -> None:
    """Make ``image`` the base release as a one-commit repository, unless it was made from the same sources
    already: another process may be grading from it (pytest workers side by side), so a finished image is
    never removed under a reader; one whose recipe changed is rebuilt."""
    stamp = source_stamp(build)
    marker = image / ".git" / build.STAMP
    if marker.is_file() and marker.read_text() == stamp:
        return
    if image.exists():
        shutil.rmtree(image)
    image.mkdir(parents=True)
    build.copy_files(base, image)
    build.git(image, "init", "-q", "-b", "main")
    build.git(image, "add", "-A")
    build.git(image, "commit", "-q", "-m", f"{PROJECT} {BASE[0]} (sdist)")
    marker.write_text(stamp)


def write_if_changed(path: Path, data: bytes) -> None:
    """``path`` holds ``data``; a reader never sees it half written (a new file renamed over the old)."""
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def build_task() -> dict[str, Any]:
    """Make the image and the eval-only test file; return the row (paths relative to this directory)."""
    build = swe_mini_build()
    image = IMAGES / PROJECT
    hidden = EVAL / PROJECT / HIDDEN_TEST
    with tempfile.TemporaryDirectory(prefix="upstream-sdists-") as tmp:
        base = unpack(sdist(*BASE), Path(tmp) / "base")
        fix = unpack(sdist(*FIX), Path(tmp) / "fix")
        make_image(build, base, image)
        write_if_changed(hidden, (fix / HIDDEN_TEST).read_bytes())
        label = gold_patch(build, base, fix)
    metadata = {
        "instance_id": INSTANCE_ID,
        "image": str(image.relative_to(HERE)),
        "workdir": WORKDIR,
        "problem_statement": PROBLEM,
        "eval_files": {HIDDEN_TEST: str(hidden.relative_to(HERE))},
        "eval_cmd": EVAL_CMD,
    }
    return {"prompt": PROBLEM, "label": label, "metadata": metadata}


def build(*, write_tasks: bool = False, dataset: Path = DATASET) -> list[dict[str, Any]]:
    """Build and return the rows; checks (or rewrites) ``dataset``. One builder at a time (a lock file):
    processes side by side never see a half-made image."""
    IMAGES.mkdir(parents=True, exist_ok=True)
    with open(IMAGES / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = [build_task()]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    if write_tasks:
        dataset.write_text(text)
    elif not dataset.exists() or dataset.read_text() != text:
        raise RuntimeError(f"{dataset} does not match what the sdists build: run {__file__} --write-tasks")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-tasks", action="store_true", help="rewrite tasks.jsonl")
    args = parser.parse_args(argv)
    rows = build(write_tasks=args.write_tasks)
    print(f"{len(rows)} upstream task(s) in {IMAGES}; dataset {DATASET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
