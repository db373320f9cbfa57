"""A Harbor task's verifier, in containers of its image (:mod:`rollbus.task_formats.harbor` reads the task).

Harbor's order: the agent's patch (or, for ``rollbus validate``'s gold, ``solution/solve.sh`` run in the
task's container) on the image's ``workdir``, scrubbed as the agent's; then, in a fresh container of the
same image, ``tests/`` mounted read-only at ``/tests`` (never in the agent's sandbox) and ``bash
/tests/test.sh`` run with ``/logs/verifier`` writable (with a disk limit, the tree and ``/logs/verifier`` are
engine-made capped volumes, read back through the engine); the reward is ``/logs/verifier/reward.txt`` (one
number), else ``reward.json`` (named numbers: the lowest counts, so every named reward must be full). The
patch is sanitised and its tree flagged as any other grade's (:mod:`rollbus.grading.run`); the containers are
:class:`~rollbus.grading.container.ContainerSandboxes`' (no network, unprivileged, no capabilities).

What Harbor asks, phase by phase: ``[verifier] timeout_sec`` is the grade's deadline (under the grader's);
``[environment] cpus``, ``memory_mb`` and ``storage_mb`` narrow the verifier's container limits (never past
the operator's); ``[verifier] user`` is the user ``test.sh`` runs as (a name looked up in the image; root,
by name or by uid, is refused: the verifier runs the policy's code) and ``solve.sh`` runs as the agent's
user. Narrowed: the verifier runs with the network off whatever the environment's baseline
``network_mode`` (a verifier that installs from the internet fails, named in the note); a verifier phase
that asks for the network by name is refused when the task is read (:mod:`rollbus.task_formats.harbor`).
Harbor's own residual stays: ``test.sh`` runs the code under test in the same container that writes the
reward file, so code that writes the reward file itself is not told apart by this path (the grader's pytest
report is not part of Harbor's contract).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any

from rollbus.grading import flags as fl
from rollbus.grading import run, trees, verdict
from rollbus.grading.patches import PatchRejected, Sanitized, sanitize
from rollbus.grading.rows import HARBOR_SOLUTION, GradingSpec, Harbor
from rollbus.grading.verdict import GradeResult, Verdict, failed
from rollbus.sandbox.base import SandboxError
from rollbus.sandbox.images import agent_workspace
from rollbus.sandbox.scratch import GRADE_SCRATCH_PREFIX, capped_scratch

TESTS = "/tests"
SOLUTION_DIR = "/solution"
LOGS = "/logs/verifier"
MAX_REWARD_BYTES = 1 << 16
REWARD_FILES = ("reward.txt", "reward.json")


async def grade_harbor(
    spec: GradingSpec, patch: bytes | str, config: run.GradeConfig, sandboxes: Any
) -> GradeResult:
    """Grade ``patch`` (or :data:`HARBOR_SOLUTION`) against a Harbor task; never raises."""
    assert isinstance(spec.grader, Harbor)
    solution = patch == HARBOR_SOLUTION
    sanitized = None
    if not solution:
        try:
            sanitized = sanitize(patch, config.max_patch_bytes)
        except PatchRejected as exc:
            return failed(exc.kind, str(exc))
    timeout_s = min(config.timeout_s, spec.timeout_s or config.timeout_s)
    run.SANDBOXES.set(sandboxes)
    try:
        async with asyncio.timeout(timeout_s):
            return await _grade(spec, spec.grader, sanitized, config, time.monotonic() + timeout_s, sandboxes)
    except TimeoutError:
        return failed(verdict.TIMEOUT, f"grading took longer than {timeout_s:g} s")
    except (SandboxError, OSError) as exc:
        return failed(verdict.SANDBOX_FAILED, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # the grader always answers
        return verdict.grader_error(exc)


async def _grade(
    spec: GradingSpec,
    harbor: Harbor,
    sanitized: Sanitized | None,
    config: run.GradeConfig,
    deadline: float,
    sandboxes: Any,
) -> GradeResult:
    tests = harbor.task_dir / str(harbor.settings.get("tests_dir") or "tests")
    if not (tests / "test.sh").is_file():
        return failed(verdict.BAD_ROW, f"{tests}/test.sh: no such file (the Harbor verifier)")
    with capped_scratch(GRADE_SCRATCH_PREFIX, config.scratch_dir, config.scratch_bytes) as tmp:
        scratch = Path(tmp)
        image = await sandboxes.tree(spec, scratch / "image")
        base = await asyncio.to_thread(agent_workspace, image.resolve(), scratch / "base")
        pristine = trees.snapshot(base)
        repo = scratch / "repo"
        raised: set[str] = set()
        if sanitized is None:
            method, log = "solution", await _solve(spec, harbor, base, repo, deadline, sandboxes)
            if log is not None:
                return failed(verdict.GRADING_SETUP_FAILED, f"solution/solve.sh: {log[-2000:]}")
        else:
            applied, log = await run.apply(base, repo, sanitized, deadline, spec.workdir)
            if applied is None:
                return failed(verdict.PATCH_FAILED, log[-2000:], flags=run.stripped_flags(sanitized))
            method = applied
            changed = trees.changes(base, pristine, repo)
            raised = run.raise_flags(spec, sanitized, changed, repo, base)
        run.restore_git(base, repo)
        trees.remove_bytecode(repo)
        logs = scratch / "logs"
        logs.mkdir()
        user = None if harbor.settings.get("verifier_user") is None else str(harbor.settings["verifier_user"])
        box = await sandboxes.sandbox(
            repo, spec.workdir, {tests: TESTS}, rw_binds={logs: LOGS}, user=user, copy_tree=True
        )
        env = run.BASE_ENV | {"HOME": box.home} | dict(harbor.settings.get("verifier_env") or {})
        try:
            if box.owner[0] == 0:
                return failed(verdict.BAD_ROW, f"verifier.user {user!r} is root in the image: refused")
            os.chown(logs, *box.owner)
            left = run.time_left(deadline)
            ran = await box.run(["bash", f"{TESTS}/test.sh"], env, spec.workdir, timeout=left)
            rewards = await _reward_files(box, logs)  # before the sandbox (and its capped /logs) is gone
        finally:
            await box.close()
        if ran.timed_out:
            raise TimeoutError
        output = ran.stdout + ran.stderr
        outcome = _outcome(rewards, ran.exit_code, run.sandbox_failure(ran), harbor)
        details = {
            "instance_id": spec.instance_id,
            "apply_method": method,
            "exit_code": ran.exit_code,
            "log": run.log_excerpt(output, config.log_excerpt_bytes),
        }
        zeroing = fl.ZEROING if config.zero_flagged else frozenset()
        return verdict.final(outcome, raised, zeroing, details)


async def _solve(
    spec: GradingSpec, harbor: Harbor, base: Path, repo: Path, deadline: float, sandboxes: Any
) -> str | None:
    """``solution/solve.sh`` run over a copy of the base tree in a container of the image; None when it
    succeeded, else its exit and output."""
    trees.copy_tree(base, repo)
    solution = harbor.task_dir / "solution"
    box = await sandboxes.sandbox(repo, spec.workdir, {solution: SOLUTION_DIR}, user=spec.user)
    env = run.BASE_ENV | {"HOME": box.home} | dict(harbor.settings.get("solution_env") or {})
    try:
        ran = await box.run(
            ["bash", f"{SOLUTION_DIR}/solve.sh"], env, spec.workdir, timeout=run.time_left(deadline)
        )
    finally:
        await box.close()
    if ran.timed_out:
        raise TimeoutError
    return None if ran.exit_code == 0 else f"exit {ran.exit_code}\n{ran.stdout}{ran.stderr}"


async def _reward_files(box: Any, logs: Path) -> dict[str, str | None]:
    """``reward.txt`` and ``reward.json`` as the verifier left them (None: absent or not a regular file):
    through the sandbox where ``/logs/verifier`` is its capped volume, else from the host directory."""
    if not getattr(box, "tree_copied", False):
        return {name: _read(logs / name) for name in REWARD_FILES}
    out: dict[str, str | None] = {}
    for name in REWARD_FILES:
        try:
            data = await box.read_file(f"{LOGS}/{name}", MAX_REWARD_BYTES)
        except (OSError, ValueError, SandboxError):
            out[name] = None
            continue
        out[name] = data.decode("utf-8", errors="replace")
    return out


def _outcome(rewards: dict[str, str | None], exit_code: int, limit: str | None, harbor: Harbor) -> Verdict:
    """The verifier's verdict from its reward file (a limit hit first)."""
    if limit:
        return Verdict(False, limit, (), f"the verifier hit a sandbox limit: {limit}")
    try:
        reward = reward_from(rewards)
    except ValueError as exc:
        network = (harbor.settings.get("network") or {}).get("verifier")
        hint = (
            " (the verifier asked for the network; it runs without one here)" if network == "public" else ""
        )
        return Verdict(False, verdict.TESTS_FAILED, (), f"{exc} (test.sh exit {exit_code}){hint}")
    if reward >= 1.0:
        return Verdict(True, None)
    return Verdict(False, verdict.TESTS_FAILED, (), f"reward {reward:g} (test.sh exit {exit_code})")


def reward_from(files: dict[str, str | None]) -> float:
    """``reward.txt``'s number, else the lowest of ``reward.json``'s; ValueError when neither reads. The
    files are the tested container's: read as bytes under a cap, never followed as links."""
    text = files.get("reward.txt")
    if text is not None:
        return _number(text.strip(), "reward.txt")
    text = files.get("reward.json")
    if text is None:
        raise ValueError("the verifier wrote no /logs/verifier/reward.txt or reward.json")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"reward.json is not JSON: {exc}") from None
    values = list(data.values()) if isinstance(data, dict) else [data]
    if not values:
        raise ValueError("reward.json names no reward")
    return min(_number(v, "reward.json") for v in values)


def _read(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_REWARD_BYTES).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def _number(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} holds {str(value)[:100]!r}, not a number") from None
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"{where} holds {value!r}, not a finite number")
    return number
