"""Grade one patch against one row, in fresh network-less sandboxes made from the original image.

Order (SWE-bench Pro's, not slime's, so the patch can never win over the grading material):

1. sanitise the patch (size cap, NUL bytes, unsafe paths: a named failure; binary hunks stripped);
2. copy the image; apply in a sandbox: ``git apply --3way``, then ``git apply``, then ``patch -p1``, each on a
   fresh copy (an empty patch applies);
3. measure what really changed against the image and raise flags (:mod:`rollbus.grading.flags`); put the
   image's ``.git`` back, so nothing the patch did there runs in the grader's git commands;
4. copy eval-only files in, delete all bytecode (and run with ``PYTHONDONTWRITEBYTECODE``);
5. in a second sandbox: the last line of ``before_repo_set_cmd`` (swepro), then exactly one of swepro's run
   script, ``eval_cmd`` or ``f2p_script``; swepro's parser runs in a third sandbox that holds only the logs;
6. decide from structured results (:mod:`rollbus.grading.verdict`); zeroing flags score 0.

The whole grade has one deadline; the sandbox of whatever runs when it passes is killed.
"""

from __future__ import annotations

import asyncio
import inspect
import shlex
import shutil
import tarfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbus.grading import flags as fl
from rollbus.grading import trees, verdict
from rollbus.grading.patches import PatchRejected, Sanitized, added_lines, sanitize
from rollbus.grading.rows import EvalCmd, F2PScript, GradingSpec, Swepro
from rollbus.grading.verdict import GradeResult, Outcome, failed
from rollbus.sandbox import BwrapSandbox, Completed, SandboxUnavailable
from rollbus.sandbox.scratch import GRADE_SCRATCH_PREFIX, capped_scratch

try:  # the hardened sandbox contract (branch `sandbox`) names start-up failures; before it, only these exist
    from rollbus.sandbox import SandboxError  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - depends on which sandbox package is merged
    SandboxError = SandboxUnavailable  # type: ignore[misc,assignment]

EVAL_DIR = "/eval"  # read-only bind of the eval-only scripts inside the grading sandbox
PATCH_NAME = "rollbus.patch"
JUNIT_NAME = ".rollbus-junit.xml"
APPLY_COMMANDS = (
    ("git-apply-3way", ["git", "apply", "--3way", "--whitespace=nowarn"]),
    ("git-apply", ["git", "apply", "--whitespace=nowarn"]),
    ("patch", ["patch", "-p1", "--no-backup-if-mismatch", "--batch", "--forward", "-i"]),
)
REFRESH_INDEX = ["git", "update-index", "-q", "--refresh"]
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONNOUSERSITE": "1",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.hooksPath",
    "GIT_CONFIG_VALUE_0": "/dev/null",
    "GIT_CONFIG_KEY_1": "core.fsmonitor",
    "GIT_CONFIG_VALUE_1": "false",
}


@dataclass(frozen=True)
class GradeConfig:
    """The grader's knobs (the service's settings map onto these)."""

    timeout_s: float = 600.0
    max_patch_bytes: int = 2**20
    zero_flagged: bool = True
    log_excerpt_bytes: int = 8192
    scratch_dir: Path | None = None
    readonly_tests: bool = True


async def grade(spec: GradingSpec, patch: str, config: GradeConfig | None = None) -> GradeResult:
    """Grade ``patch`` against the row ``spec``; never raises for anything the patch or the row does."""
    config = config or GradeConfig()
    try:
        sanitized = sanitize(patch, config.max_patch_bytes)
    except PatchRejected as exc:
        return failed(exc.kind, str(exc))
    started = time.monotonic()
    try:
        async with asyncio.timeout(config.timeout_s):
            return await _grade(spec, sanitized, config, started + config.timeout_s)
    except TimeoutError:
        return failed(verdict.TIMEOUT, f"grading took longer than {config.timeout_s:g} s")
    except (SandboxUnavailable, SandboxError, OSError, tarfile.TarError) as exc:
        return failed(verdict.SANDBOX_FAILED, f"{type(exc).__name__}: {exc}")


async def _grade(
    spec: GradingSpec, sanitized: Sanitized, config: GradeConfig, deadline: float
) -> GradeResult:
    missing = [str(p) for p in eval_material(spec) if not p.is_file()]
    if missing:
        return failed(verdict.BAD_ROW, f"eval-only files missing: {', '.join(missing)}")
    with capped_scratch(GRADE_SCRATCH_PREFIX, config.scratch_dir) as tmp:  # a capped tmpfs: disk never grows
        scratch = Path(tmp)
        image = materialize(spec.image, scratch / "image")
        pristine = trees.snapshot(image)
        repo = scratch / "repo"
        method, apply_log = await apply(image, repo, sanitized, deadline, spec.workdir)
        if method is None:
            return failed(verdict.PATCH_FAILED, apply_log[-2000:], flags=_binary(sanitized))
        changed = trees.changes(image, pristine, repo)
        raised = raise_flags(spec, sanitized, changed, repo)
        restore_git(image, repo)
        for dest, src in spec.eval_files.items():
            trees.place_file(repo, dest, src.read_bytes())
        removed = trees.remove_bytecode(repo)
        eval_dir = scratch / "eval"
        eval_dir.mkdir()
        outcome, log = await run_grader(spec, repo, eval_dir, scratch, deadline, config.readonly_tests)
        details = {
            "instance_id": spec.instance_id,
            "apply_method": method,
            "changed_files": sorted(p for p in changed if not p.startswith(".git/"))[:200],
            "bytecode_removed": removed,
            "stripped_binary": list(sanitized.stripped_binary),
            "log": _excerpt(log, config.log_excerpt_bytes),
        }
        zeroing = fl.ZEROING if config.zero_flagged else frozenset()
        return verdict.final(outcome, raised, zeroing, details)


def eval_material(spec: GradingSpec) -> list[Path]:
    """Host files the row's grading needs (none of them ever enters an agent's sandbox)."""
    paths = list(spec.eval_files.values())
    if isinstance(spec.grader, Swepro):
        paths += [spec.grader.run_script, spec.grader.parser_script]
    return paths


def raise_flags(spec: GradingSpec, sanitized: Sanitized, changed: Mapping[str, str], repo: Path) -> set[str]:
    raised = fl.path_flags(changed, spec.test_files(), trees.package_dirs(repo))
    raised |= fl.path_flags({p: "modified" for p in sanitized.paths if p.startswith(".git/")}, (), ())
    raised |= fl.content_flags(added_lines(sanitized.patch))
    return raised | _binary(sanitized)


def _binary(sanitized: Sanitized) -> set[str]:
    return {fl.BINARY_STRIPPED} if sanitized.stripped_binary else set()


def materialize(image: Path, dest: Path) -> Path:
    """The image as a directory: itself, or a tarball unpacked (its root, or its single top-level dir)."""
    if image.is_dir():
        return image
    if not image.is_file():
        raise FileNotFoundError(f"image {image} does not exist (build it first?)")
    dest.mkdir(parents=True)
    with tarfile.open(image) as archive:
        archive.extractall(dest, filter="tar")
    entries = list(dest.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


def grading_sandbox(
    repo: Path, workdir: str, eval_dir: Path | None = None, protected: Sequence[str] = ()
) -> BwrapSandbox:
    """A network-less sandbox over ``repo``, at the row's ``workdir`` where the backend can mount it there
    (the hardened contract's ``inside_workdir``; otherwise ``/workspace``), eval scripts read-only at
    ``/eval``, and the ``protected`` repository paths mounted read-only over themselves."""
    inside = workdir if "inside_workdir" in inspect.signature(BwrapSandbox).parameters else "/workspace"
    binds: dict[Path, str] = {eval_dir: EVAL_DIR} if eval_dir is not None else {}
    binds |= {repo / rel: f"{inside}/{rel}" for rel in protected}
    options: dict[str, Any] = {"network": "none", "ro_binds": binds}
    if inside != "/workspace":
        options["inside_workdir"] = inside
    return BwrapSandbox(repo, **options)


async def apply(
    image: Path, repo: Path, sanitized: Sanitized, deadline: float, workdir: str
) -> tuple[str | None, str]:
    """Apply with each tool in turn on a fresh copy; (method, log), method None when none applied it."""
    trees.copy_tree(image, repo)
    if not sanitized.patch:
        return "empty", ""
    logs = []
    for attempt, (name, argv) in enumerate(APPLY_COMMANDS):
        if attempt:
            shutil.rmtree(repo)
            trees.copy_tree(image, repo)
        sandbox = grading_sandbox(repo, workdir)
        env = BASE_ENV | {"HOME": sandbox.home}
        try:
            target = f"{sandbox.home}/{PATCH_NAME}"
            await sandbox.write_file(target, sanitized.patch)
            if name == "git-apply-3way":  # a copied index has stale stat data: "does not match index"
                await sandbox.run(REFRESH_INDEX, env, timeout=_left(deadline))
            done = await sandbox.run([*argv, target], env, timeout=_left(deadline))
        finally:
            await sandbox.close()
        logs.append(f"$ {name}: exit {done.exit_code}\n{done.stdout}{done.stderr}")
        if done.exit_code == 0 and not done.timed_out:
            return name, "".join(logs)
    return None, "".join(logs)


def restore_git(image: Path, repo: Path) -> None:
    """Put the image's own ``.git`` back: the grader's git commands must read trusted config and refs only."""
    git = repo / ".git"
    if git.is_symlink() or git.is_file():
        git.unlink()
    elif git.exists():
        shutil.rmtree(git)
    if (image / ".git").is_dir():
        shutil.copytree(image / ".git", git, symlinks=True)


async def run_grader(
    spec: GradingSpec, repo: Path, eval_dir: Path, scratch: Path, deadline: float, readonly_tests: bool = True
) -> tuple[Outcome, str]:
    """The row's one grader. swepro's target tests are restored first, in a sandbox of their own, so the
    test sandbox can then mount the row's test directories read-only: code under test that rewrites a test
    file not yet collected (or re-executes pytest on rewritten ones) fails to write."""
    grader = spec.grader
    if isinstance(grader, Swepro):
        shutil.copyfile(grader.run_script, eval_dir / "run_script.sh")
        shutil.copyfile(grader.parser_script, eval_dir / "parser.py")
        restore = grading_sandbox(repo, spec.workdir)
        try:
            restored = await restore.run(
                shell(spec, grader.restore_cmd), BASE_ENV | {"HOME": restore.home}, timeout=_left(deadline)
            )
        finally:
            await restore.close()
        if restored.exit_code != 0 or restored.timed_out:
            log = restored.stdout + restored.stderr
            return Outcome(False, verdict.GRADING_SETUP_FAILED, (), "before_repo_set_cmd failed"), log
    elif isinstance(grader, F2PScript):
        (eval_dir / "f2p.py").write_text(grader.script)
    protected = trees.protected_dirs(repo, spec.test_files()) if readonly_tests else []
    sandbox = grading_sandbox(repo, spec.workdir, eval_dir, protected)
    try:
        if isinstance(grader, Swepro):
            return await _run_swepro(spec, grader, sandbox, eval_dir, scratch, deadline)
        return await _run_command(spec, sandbox, deadline)
    finally:
        await sandbox.close()


async def _run_swepro(
    spec: GradingSpec, grader: Swepro, sandbox: BwrapSandbox, eval_dir: Path, scratch: Path, deadline: float
) -> tuple[Outcome, str]:
    files = shlex.quote(",".join(grader.selected_test_files))
    command = shell(spec, f"bash {EVAL_DIR}/run_script.sh {files}")
    ran = await sandbox.run(command, BASE_ENV | {"HOME": sandbox.home}, timeout=_left(deadline))
    log = ran.stdout + ran.stderr
    if ran.timed_out:
        raise TimeoutError
    if limit := sandbox_failure(ran):
        return Outcome(False, limit, (), f"the tests hit a sandbox limit: {limit}"), log
    return await parse_swepro(grader, ran, eval_dir, scratch, deadline), log


async def _run_command(spec: GradingSpec, sandbox: BwrapSandbox, deadline: float) -> tuple[Outcome, str]:
    """eval_cmd or f2p_script, with pytest asked for a JUnit report the verdict cross-checks."""
    grader = spec.grader
    assert isinstance(grader, EvalCmd | F2PScript)
    command = grader.cmd if isinstance(grader, EvalCmd) else f"python3 {EVAL_DIR}/f2p.py"
    text = grader.cmd if isinstance(grader, EvalCmd) else grader.script
    junit_path = f"{sandbox.home}/{JUNIT_NAME}"
    env = BASE_ENV | {"HOME": sandbox.home, "PYTEST_ADDOPTS": f"--junitxml={junit_path}"}
    ran = await sandbox.run(shell(spec, command), env, timeout=_left(deadline))
    log = ran.stdout + ran.stderr
    if ran.timed_out:
        raise TimeoutError
    if limit := sandbox_failure(ran):
        return Outcome(False, limit, (), f"the tests hit a sandbox limit: {limit}"), log
    junit = await _read_optional(sandbox, junit_path)
    pytest_ran = verdict.runs_pytest(text) or junit is not None  # a report, however pytest was started
    outcome = verdict.command_outcome(
        ran.exit_code, log, runs_pytest=pytest_ran, junit=junit, runs_unittest=verdict.runs_unittest(text)
    )
    return outcome, log


async def parse_swepro(
    grader: Swepro, ran: Completed, eval_dir: Path, scratch: Path, deadline: float
) -> Outcome:
    """Run the row's parser over the logs in a sandbox of its own (nothing of the tested code is there)."""
    if ran.timed_out:
        raise TimeoutError
    logs = scratch / "logs"
    logs.mkdir()
    (logs / "stdout.log").write_text(ran.stdout)
    (logs / "stderr.log").write_text(ran.stderr)
    sandbox = grading_sandbox(logs, "/workspace", eval_dir)
    try:
        w = sandbox.workdir
        argv = [
            "python3",
            "-I",
            f"{EVAL_DIR}/parser.py",
            f"{w}/stdout.log",
            f"{w}/stderr.log",
            f"{w}/output.json",
        ]
        parsed = await sandbox.run(argv, BASE_ENV | {"HOME": sandbox.home}, timeout=_left(deadline))
        output = await _read_optional(sandbox, f"{w}/output.json")
    finally:
        await sandbox.close()
    if parsed.timed_out:
        raise TimeoutError
    if parsed.exit_code != 0 or output is None:
        return Outcome(
            False, verdict.PARSER_FAILED, (), f"parser exit {parsed.exit_code}: {parsed.stderr[-500:]}"
        )
    try:
        reported = verdict.parse_parser_output(output)
    except ValueError as exc:
        return Outcome(False, verdict.PARSER_FAILED, (), str(exc))
    return verdict.swepro_outcome(reported, grader.required)


def sandbox_failure(done: Completed) -> str | None:
    """The limit a command hit (memory, processes, disk, output), as the hardened sandbox names it."""
    kind = getattr(done, "failure_kind", None)
    return None if kind in (None, "timeout") else str(kind)


def shell(spec: GradingSpec, command: str) -> list[str]:
    """``command`` in bash, after the row's ``pre_commands`` (environment set-up shares its shell)."""
    return ["bash", "-c", "\n".join([*spec.pre_commands, command])]


async def _read_optional(sandbox: BwrapSandbox, path: str) -> str | None:
    try:
        data = await sandbox.read_file(path)
    except (OSError, ValueError):
        return None
    return data[: verdict.MAX_REPORT_BYTES + 1].decode("utf-8", errors="replace")


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _excerpt(text: str, limit: int) -> str:
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


def grade_sync(spec: GradingSpec, patch: str, config: GradeConfig | None = None) -> GradeResult:
    return asyncio.run(grade(spec, patch, config))
