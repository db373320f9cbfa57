"""One attempt at one task, on any backend: boot a sandbox, run the row's agent harness (a real coding-agent
CLI, :mod:`harnesses`) against the adapter, take its patch through the sandbox contract.

Every way an attempt can end becomes an :class:`~rollbus.services.sandbox_runner.outcome.AttemptResult` with a
failure kind (never an exception), so every attempt ends with a `diffs` event. The sandbox is killed and the
adapter session closed on every path, cancellation included (a runner shutting down abandons its attempts;
their tasks stay uncommitted and are re-run as new attempts).

Threat model: the agent is the attacker and owns everything in its workspace. It gets the prompt, its own
session token (good for this attempt only; revoked when the attempt ends) and a complete environment (no host
variables, no admin token); the row, the label and every grading file stay on the host. Its patch is taken
once its processes are gone, by git run inside its sandbox (the sandbox's memory cap, the host's git, no
network) against a trusted baseline bound read-only, every git config it could plant ignored (symlinks stay
links); the bytes stream to the host under the patch cap (:mod:`rollbus.sandbox.capture`), so whatever the
workspace holds the runner holds at most the cap (on E2B the VM is the isolation: see
:meth:`rollbus.sandbox.e2b_backend.E2BSandbox.capture_patch`). What the agent prints only feeds the turn count
and errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from rollbus.sandbox import (
    Completed,
    SandboxBase,
    SandboxError,
    SandboxSpec,
    create_sandbox,
    resolve_image,
)
from rollbus.sandbox.bwrap_layout import WORKSPACE
from rollbus.sandbox.capture import Captured
from rollbus.sandbox.e2b_backend import E2BOptions
from rollbus.services.sandbox_runner import harnesses
from rollbus.services.sandbox_runner import outcome as kinds
from rollbus.services.sandbox_runner.harnesses import Exit, Harness, Where
from rollbus.services.sandbox_runner.outcome import AttemptResult, cap_patch, drop_paths
from rollbus.services.sandbox_runner.settings import RunnerSettings
from rollbus.task_image import ImageFieldError, parse_image, parse_user, row_limits

log = logging.getLogger("rollbus.sandbox_runner")
PROBE_TIMEOUT_S = 60.0
CAPTURE_TIMEOUT_S = 300.0
ADAPTER_TRIES = 3
ADAPTER_MAX_PAUSE_S = 5.0


class AttemptFailed(Exception):
    """An attempt ended early; ``kind`` names why (one of the kinds in :mod:`outcome`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class AdapterSessions:
    """The adapter's admin sessions API: one session (and token) per attempt, closed when it ends.

    Opening waits up to ``wait`` seconds for an adapter that does not answer (restarting: its port is
    closed until it is ready) before the attempt fails as ``session_failed``; closing tries briefly, since
    the adapter's idle expiry closes what it misses."""

    def __init__(self, url: str, admin_token: str, timeout: float, wait: float = 0.0) -> None:
        headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout)
        self.wait = wait

    async def open(self, rollout_id: str, attempt_id: str, harness: str = "claude_code") -> str:
        """A token for a new attempt. What an earlier attempt left open (its runner died mid-rollout) is
        closed first, so its chains end and the new attempt starts a conversation of its own."""
        deadline = time.monotonic() + self.wait
        await self.close(rollout_id, None, deadline)
        # the token opens its CLI's route only (/v1/messages or /v1/responses), not one of a tool's choosing
        body = {"rollout_id": rollout_id, "attempt_id": attempt_id, "harness": harness}
        answer = await self._post("/admin/sessions", body, deadline)
        if answer.status_code != 200 or not isinstance(answer.json().get("token"), str):
            raise AttemptFailed(kinds.SESSION_FAILED, f"adapter refused a session: {answer.status_code} "
                                f"{answer.text[:300]}")  # fmt: skip
        return str(answer.json()["token"])

    async def close(self, rollout_id: str, attempt_id: str | None, deadline: float | None = None) -> None:
        """Close the attempt's session (every session of the rollout with ``attempt_id=None``); 404 (no
        request ever reached it) is fine."""
        body = {"attempt_id": attempt_id} if attempt_id else {}
        try:
            answer = await self._post(f"/admin/sessions/{rollout_id}/close", body, deadline)
        except AttemptFailed as exc:
            log.warning("closing the session of %s/%s: %s", rollout_id, attempt_id, exc)
            return
        if answer.status_code not in (200, 404):
            log.warning("closing the session of %s/%s: %s %s", rollout_id, attempt_id, answer.status_code,
                        answer.text[:300])  # fmt: skip

    async def _post(self, path: str, body: dict[str, Any], deadline: float | None) -> httpx.Response:
        """POST, tried again while the adapter is unreachable: ``ADAPTER_TRIES`` times, or until ``deadline``
        (``time.monotonic()``) if that is later."""
        for attempt in itertools.count():
            try:
                return await self._http.post(path, json=body)
            except httpx.TransportError as exc:  # the adapter restarting: try again shortly
                pause = min(0.5 * 2**attempt, ADAPTER_MAX_PAUSE_S)
                if attempt >= ADAPTER_TRIES - 1 and time.monotonic() + pause > (deadline or 0.0):
                    raise AttemptFailed(kinds.SESSION_FAILED, f"adapter unreachable: {exc!r}") from exc
                if attempt == ADAPTER_TRIES - 1:
                    log.warning("the adapter does not answer %s: waiting for it", path)
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._http.aclose()


@dataclass
class RunnerKit:
    """What every attempt of one runner shares."""

    settings: RunnerSettings
    sessions: AdapterSessions
    boot_gate: asyncio.Semaphore = field(init=False)
    limits_logged: bool = False
    sdk: Any = None  # e2b: the SDK's AsyncSandbox class (None: the real one; tests pass a fake)
    e2b_options: E2BOptions | None = None  # e2b: None reads them from the settings at first use
    tarballs: Any = None  # e2b: the host-side tarballs, prepared once (remote.Tarballs)
    creations: int = 0  # sandbox creations started by this runner (--inject-infra-failures counts them)

    def __post_init__(self) -> None:
        self.boot_gate = asyncio.Semaphore(self.settings.boot_concurrency)
        if self.settings.backend == "e2b" and self.e2b_options is None:
            self.e2b_options = self.settings.e2b_options()


def new_attempt_id() -> str:
    return f"att-{uuid.uuid4().hex[:12]}"


def task_prompt(task: dict[str, Any], metadata: dict[str, Any], template: str) -> str:
    """The agent's prompt: the row's problem statement (else its prompt) in the configured template."""
    statement = metadata.get("problem_statement")
    if not isinstance(statement, str) or not statement.strip():
        statement = task.get("prompt") or ""
    return template.replace("{prompt}", statement)


def parse_metadata(task: dict[str, Any]) -> dict[str, Any]:
    try:
        metadata = json.loads(task.get("metadata") or "{}")
    except json.JSONDecodeError as exc:
        raise AttemptFailed(kinds.BAD_TASK, f"metadata is not JSON: {exc}") from exc
    if not isinstance(metadata, dict):
        raise AttemptFailed(kinds.BAD_TASK, "metadata is not a JSON object")
    return metadata


async def run_task(kit: RunnerKit, task: dict[str, Any], attempt_id: str | None = None) -> AttemptResult:
    """Run ``task`` once, as a new attempt; always returns its outcome (a failure kind instead of raising)."""
    attempt_id = attempt_id or new_attempt_id()
    started = time.monotonic()
    try:
        return await _attempt(kit, task, attempt_id)
    except AttemptFailed as exc:
        log.info("rollout %s attempt %s: %s: %s", task["rollout_id"], attempt_id, exc.kind, exc)
        return AttemptResult(attempt_id, failure_kind=exc.kind, error=str(exc)[:4000],
                       wall_time_s=time.monotonic() - started)  # fmt: skip
    except Exception as exc:  # a runner bug or a host failure: still an outcome, never a lost rollout
        log.exception("rollout %s attempt %s failed in the runner", task["rollout_id"], attempt_id)
        error = f"{type(exc).__name__}: {exc}"[:4000]
        return AttemptResult(attempt_id, failure_kind=kinds.RUNNER_ERROR, error=error,
                       wall_time_s=time.monotonic() - started)  # fmt: skip


async def _attempt(kit: RunnerKit, task: dict[str, Any], attempt_id: str) -> AttemptResult:
    """One attempt on any backend: boot the sandbox and place the harness's CLI in it (mounted locally,
    installed in an E2B VM), open its session, run it, take its patch through the sandbox contract."""
    settings, rollout_id = kit.settings, task["rollout_id"]
    metadata = parse_metadata(task)
    harness = harnesses.harness(chosen_agent(metadata, settings, task))
    placing = placement(kit)
    sandbox = await placing.boot(kit, metadata, attempt_id, harness)
    started = False  # once the agent ran in the sandbox, the sandbox failing may be its doing
    try:
        try:
            where = await placing.place(kit, sandbox, harness)
            token = await kit.sessions.open(rollout_id, attempt_id, harness.adapter_harness)
            try:
                started = True
                prompt = task_prompt(task, metadata, settings.prompt_template)
                timeout = agent_timeout(settings, metadata)
                launch = harness.launch(settings, where, prompt, token, timeout)
                # the adapter proxy knows the CLI's process; the token reaches the CLI through a pipe, never
                # the sandbox's configuration (bwrap's pid 1 is readable by the tools, `docker inspect`)
                completed = await sandbox.run(
                    launch.cmd, launch.env, cwd=sandbox.workdir, timeout=timeout, agent=True,
                    secret_env=launch.secrets,
                )  # fmt: skip
            finally:  # the sandbox is dead here (run returns once its processes are gone): no more requests
                await kit.sessions.close(rollout_id, attempt_id)
            captured = await sandbox.capture_patch(
                settings.patch_max_bytes + 1, settings.excluded(), CAPTURE_TIMEOUT_S
            )  # one byte over the cap says "more"
        finally:
            await sandbox.close()
    except AttemptFailed:
        raise
    except Exception as exc:
        if not started:
            raise
        raise broken_by_agent(exc) from exc
    result = attempt_outcome(
        attempt_id, completed, captured, settings.patch_max_bytes, harness.read_exit, settings.excluded()
    )
    return dataclasses.replace(result, image_digest=sandbox.image_digest)  # the bytes a regrade must use


def broken_by_agent(exc: Exception) -> AttemptFailed:
    """What a failure of the sandbox (or of the runner's work in it) is once the agent has run there:
    ``sandbox_broken``, a policy failure (:mod:`rollbus.failures`), since the agent may have caused it.
    Only what failed before the agent started may be the infrastructure's (``runner_error``)."""
    return AttemptFailed(kinds.SANDBOX_BROKEN, f"{type(exc).__name__}: {exc}")


def attempt_outcome(
    attempt_id: str,
    completed: Completed,
    captured: Captured,
    max_bytes: int,
    read_exit: Callable[[Completed], Exit] = harnesses.stream_json_exit,
    excluded: Sequence[str] = (),
) -> AttemptResult:
    """The agent's failure wins, then the capture's (its limits: no patch at all), then the cap's. Our own
    paths are dropped from the patch again here, whatever the backend's capture left."""
    patch, truncated = cap_patch(drop_paths(captured.patch, list(excluded)), max_bytes)
    exit_ = read_exit(completed)
    failure = exit_.failure
    error = completed.stderr.strip()[-2000:] or None if failure else None
    if captured.failure and not truncated:
        patch, failure = b"", failure or kinds.PATCH_FAILED
        error = error or f"taking the patch: {captured.failure}: {captured.error.strip()}"[:2000]
    failure = failure or (kinds.PATCH_TOO_LARGE if truncated else None)
    return AttemptResult(
        attempt_id, patch, completed.exit_code, completed.wall_time_s, exit_.turns, failure, error, truncated
    )


def agent_timeout(settings: RunnerSettings, metadata: dict[str, Any]) -> float:
    """``--agent-timeout``, or the row's ``agent_timeout_sec`` when it asks for less (a Harbor task's)."""
    return row_limits(settings.limits(), metadata).wall_s


def chosen_agent(metadata: dict[str, Any], settings: RunnerSettings, task: dict[str, Any]) -> str:
    """The harness of this sample of the row (``metadata.agent``: one, or a list the group's samples take in
    turn; else ``--agent``); an unknown one is a bad task."""
    try:
        return harnesses.chosen(metadata, settings.agent, task.get("sample_index") or 0)
    except harnesses.UnknownAgent as exc:
        raise AttemptFailed(kinds.BAD_TASK, str(exc)) from exc


def host_files(harness: Harness, settings: RunnerSettings) -> dict[str, str]:
    """What the sandbox mounts read-only for ``harness`` (its CLI installed by bootstrap, never fetched
    mid-rollout); a CLI missing here is ``install_failed``."""
    try:
        return harness.host_files(settings)
    except harnesses.NotInstalled as exc:
        raise AttemptFailed(kinds.INSTALL_FAILED, str(exc)) from exc


def sandbox_spec(
    settings: RunnerSettings, metadata: dict[str, Any], ro_binds: dict[str, str], sandbox_id: str
) -> SandboxSpec:
    """The agent's sandbox: the image's base commit, the adapter as its only way out, the CLI read-only."""
    env = info if isinstance(info := metadata.get("remote_env_info"), dict) else {}
    try:
        image = parse_image(metadata.get("image") or env.get("image"))
        user = parse_user(metadata.get("user") or env.get("user"))
    except ImageFieldError as exc:
        raise AttemptFailed(kinds.BAD_TASK, str(exc)) from exc
    # a container image the engine has, by name; a host directory or tarball (bwrap's; on docker the sandbox
    # runs it in an image of that tree: rollbus.sandbox.docker_images.ensure_tree_image)
    on_host = image.kind == "path" and (settings.backend != "docker" or Path(image.text).exists())
    container = None if on_host else image.text
    return SandboxSpec(
        image=Path(image.text) if container else resolve_image(image.text), container_image=container,
        user=user, role="agent", workdir=str(metadata.get("workdir") or WORKSPACE),
        limits=row_limits(settings.limits(), metadata), adapter_url=settings.adapter_url,
        base_url=settings.agent_base_url(),
        toolchain=settings.toolchain, metadata=metadata, sandbox_id=sandbox_id, ro_binds=ro_binds,
    )  # fmt: skip


class Placement(Protocol):
    """How a backend makes an attempt's sandbox and puts the harness's CLI in it."""

    async def boot(
        self, kit: RunnerKit, metadata: dict[str, Any], attempt_id: str, harness: Harness
    ) -> SandboxBase: ...

    async def place(self, kit: RunnerKit, sandbox: SandboxBase, harness: Harness) -> Where: ...


class Mounted:
    """bwrap and docker: a sandbox of this machine, the CLI's host files mounted read-only."""

    async def boot(
        self, kit: RunnerKit, metadata: dict[str, Any], attempt_id: str, harness: Harness
    ) -> SandboxBase:
        files = host_files(harness, kit.settings)  # before any sandbox: a missing CLI is no boot failure
        return await boot(kit, metadata, files, attempt_id)

    async def place(self, kit: RunnerKit, sandbox: SandboxBase, harness: Harness) -> Where:
        return Where(kit.settings.agent_base_url(), sandbox.home, sandbox.workdir)


def placement(kit: RunnerKit) -> Placement:
    if kit.settings.backend == "e2b":
        from rollbus.services.sandbox_runner.remote import Installed

        return Installed()
    return Mounted()


async def boot(
    kit: RunnerKit, metadata: dict[str, Any], ro_binds: dict[str, str], attempt_id: str
) -> SandboxBase:
    """The agent's sandbox, probed with one command; retried (with a new sandbox) under the boot cap."""
    settings = kit.settings

    async def start(n: int) -> SandboxBase:
        spec = sandbox_spec(settings, metadata, ro_binds, f"{attempt_id}-{n}")
        sandbox = await create_sandbox(spec, settings.backend, scratch_root=settings.sandbox_root)
        try:
            probe = await sandbox.run(["true"], {"PATH": "/usr/bin:/bin"}, timeout=PROBE_TIMEOUT_S)
            if probe.exit_code != 0 or probe.timed_out:
                raise SandboxError(f"probe exited {probe.exit_code}: {probe.stderr.strip()[-500:]}")
        except BOOT_ERRORS:  # a failed boot is killed before it is retried
            with contextlib.suppress(Exception):
                await sandbox.close()
            raise
        return sandbox

    return await boot_retrying(kit, start, "")


BOOT_ERRORS = (SandboxError, OSError, ValueError)


class InjectedFailure(SandboxError):
    """A sandbox creation failed on purpose (``--inject-infra-failures``): final, like a missing image, so the
    attempt ends ``boot_failed`` and the infrastructure path (re-run, never trained) is exercised."""


S = TypeVar("S", bound=SandboxBase)


async def boot_retrying(kit: RunnerKit, start: Callable[[int], Awaitable[S]], limits_note: str) -> S:
    """``start(n)`` for n = 0, 1, ... under the boot cap, with exponential backoff between tries, until one
    boots (each backend's ``start`` kills what it made before raising). An image error is final: a missing
    or unreadable image will not appear on retry. What the sandboxes enforce is logged once per runner."""
    settings = kit.settings
    async with kit.boot_gate:
        failure: Exception | None = None
        for n in range(settings.boot_attempts):
            if n:
                await asyncio.sleep(settings.boot_backoff * 2 ** (n - 1))
            kit.creations += 1
            if kit.creations <= settings.inject_infra_failures:
                failure = InjectedFailure(
                    f"injected infrastructure failure {kit.creations} of {settings.inject_infra_failures} "
                    "(--inject-infra-failures)"
                )
                break
            try:
                sandbox = await start(n)
            except BOOT_ERRORS as exc:
                failure = exc
                if getattr(exc, "failure_kind", None) == "image_error":
                    break
                continue
            if not kit.limits_logged:
                kit.limits_logged = True
                log.info("sandbox limits enforced%s: %s", limits_note, dict(getattr(sandbox, "enforced", {})))
            return sandbox
    kind = getattr(failure, "failure_kind", "sandbox_error")
    raise AttemptFailed(kinds.BOOT_FAILED, f"{kind}: {failure}")
