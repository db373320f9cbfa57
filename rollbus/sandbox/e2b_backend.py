"""E2B backend: the sandbox contract over a cloud micro-VM (``e2b.AsyncSandbox``, SDK 2.x).

The VM is the isolation. Routing: the template is the row's ``metadata.e2b_template`` or the configured
default; every VM carries the metadata of ``ROLLBUS_E2B_METADATA_FILE`` (a JSON object of strings, e.g.
cluster routing labels) plus the row's image under ``ROLLBUS_E2B_IMAGE_METADATA_KEY`` (default ``image``), its
sandbox id and role. Graders get no network (``allow_internet_access=False``); agents may reach the adapter's
host only (``network.allow_out``), or nothing.

Robustness: creation passes the sandbox id as the idempotency key, so a retried create cannot start two VMs;
only transient transport errors (unreachable, rate limit, busy, connection errors) are retried; a VM whose
setup fails after ``create`` is killed before the error propagates, and one whose caller is cancelled while
``create`` is in flight is killed as soon as it exists. Commands start detached with output
redirected to files in the VM and are polled for an exit-code file, so a 30-minute agent run survives a
dropped stream; a deadline or a cancelled ``run`` kills the remote process group.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import secrets
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from rollbus.sandbox.base import Completed, FailureKind, SandboxBase, SandboxError
from rollbus.sandbox.process import BoundedOutput

if TYPE_CHECKING:
    from rollbus.sandbox.capture import Captured

E2B_HOME = "/home/user"
E2B_WORKSPACE = "/home/user/workspace"
RUN_DIR = "/tmp/.rollbus"
KILLED_EXIT_CODE = -9
T = TypeVar("T")

# History-free agent repository, as images.agent_workspace does locally: tracked files become the only commit.
AGENT_REPO_SETUP = (
    "set -e; cd {workdir}; tracked=$(mktemp); "
    "if [ -d .git ]; then git ls-files -z > $tracked; rm -rf .git; fi; "
    "git init -q --template= -b main; "
    "if [ -s $tracked ]; then git add -f --pathspec-from-file=$tracked --pathspec-file-nul; "
    "else git add -A; fi; "
    "git -c user.name=rollbus -c user.email=rollbus@localhost commit -q --allow-empty --no-verify -m base; "
    "rm -rf .git/logs $tracked"
)
# The patch: every change since the base commit recorded at boot, new files included, our paths left out;
# git's configurable ways to run code or rewrite output are off. Written whole, then cut (its full size
# noted), so a failing git is seen and a cut is known.
DIFF_SCRIPT = (
    "cd {w} && git -c core.hooksPath=/dev/null -c core.fsmonitor=false add -N -- {x} && "
    "git -c core.fsmonitor=false diff --binary --no-ext-diff --no-textconv --no-color {base} -- {x} "
    "> {out}.full; status=$?; head -c {n} {out}.full > {out}; wc -c < {out}.full > {out}.size; "
    "rm -f {out}.full; exit $status"
)
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_NO_REPLACE_OBJECTS": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_PAGER": "cat",
}


@dataclass(frozen=True)
class E2BOptions:
    """How VMs are made; ``from_env`` reads the ``ROLLBUS_E2B_*`` variables."""

    template: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    image_metadata_key: str = "image"
    lifetime_s: int = 3600
    attempts: int = 3
    backoff_s: float = 1.0
    poll_s: float = 2.0
    output_bytes: int = 8 << 20
    run_dir: str = RUN_DIR  # in the VM: each command's output, exit code and process group id

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **overrides: Any) -> E2BOptions:
        metadata: dict[str, str] = {}
        if path := env.get("ROLLBUS_E2B_METADATA_FILE"):
            try:
                loaded = json.loads(Path(path).read_text())
            except (OSError, ValueError) as exc:
                raise SandboxError(f"ROLLBUS_E2B_METADATA_FILE {path}: {exc}") from exc
            if not isinstance(loaded, dict) or not all(isinstance(v, str) for v in loaded.values()):
                raise SandboxError(f"ROLLBUS_E2B_METADATA_FILE {path}: expected a JSON object of strings")
            metadata = loaded
        key = env.get("ROLLBUS_E2B_IMAGE_METADATA_KEY", "image")
        return cls(
            template=env.get("ROLLBUS_E2B_TEMPLATE"), metadata=metadata, image_metadata_key=key, **overrides
        )


def transient(exc: BaseException) -> bool:
    """Worth retrying: the VM or API was unreachable or busy, not wrong (never a command's own failure)."""
    import e2b

    if isinstance(exc, e2b.SandboxNotRunningException):
        return False
    kinds: tuple[type[BaseException], ...] = (
        e2b.SandboxUnreachableException,
        e2b.RateLimitException,
        e2b.ServiceBusyException,
        ConnectionError,
    )
    try:
        import httpx

        kinds += (httpx.TransportError,)
    except ImportError:  # pragma: no cover - httpx comes with the SDK
        pass
    return isinstance(exc, kinds)


async def with_retries(call: Callable[[], Awaitable[T]], options: E2BOptions) -> T:
    """``call()``, retried with exponential backoff on transient errors only."""
    for attempt in itertools.count(1):
        try:
            return await call()
        except Exception as exc:
            if attempt >= options.attempts or not transient(exc):
                raise
            await asyncio.sleep(options.backoff_s * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


_orphan_kills: set[asyncio.Future[None]] = set()  # strong references until each kill is done


def routing(
    spec_metadata: Mapping[str, Any], role: str, sandbox_id: str, options: E2BOptions
) -> dict[str, Any]:
    """Template and metadata for ``AsyncSandbox.create``."""
    metadata = {**options.metadata, "rollbus_sandbox_id": sandbox_id, "rollbus_role": role}
    if (image := spec_metadata.get("image")) is not None:
        metadata[options.image_metadata_key] = str(image)
    return {"template": spec_metadata.get("e2b_template") or options.template, "metadata": metadata}


def network_options(role: str, adapter_url: str | None) -> dict[str, Any]:
    """Graders: no network. Agents: the adapter's host only (or nothing without an adapter)."""
    if role == "grader" or not adapter_url:
        return {"allow_internet_access": False}
    host = urlsplit(adapter_url).hostname
    return {"network": {"deny_out": ["0.0.0.0/0"], "allow_out": [host]}}


class E2BSandbox(SandboxBase):
    """Wraps a live SDK sandbox. Build one with :meth:`create`; tests pass a fake SDK object."""

    def __init__(
        self,
        sdk_sandbox: Any,
        *,
        workdir: str = E2B_WORKSPACE,
        home: str = E2B_HOME,
        options: E2BOptions | None = None,
        sandbox_id: str | None = None,
    ) -> None:
        self._sbx = sdk_sandbox
        self.workdir = workdir
        self.home = home
        self.options = options or E2BOptions()
        self.sandbox_id = sandbox_id or str(getattr(sdk_sandbox, "sandbox_id", "")) or secrets.token_hex(8)
        self.enforced = {
            "isolation": "E2B micro-VM",
            "output": "head+tail capture",
            "wall_clock": "remote kill",
        }
        self._runs = itertools.count()
        self._closed = False
        self.base_commit: str | None = None  # the agent's baseline, recorded before it runs (agent role)

    @classmethod
    async def create(
        cls,
        *,
        role: str = "agent",
        metadata: Mapping[str, Any] | None = None,
        adapter_url: str | None = None,
        workdir: str = E2B_WORKSPACE,
        options: E2BOptions | None = None,
        sandbox_id: str | None = None,
        sdk: Any = None,
        **sdk_options: Any,
    ) -> E2BSandbox:
        """Start a VM (the SDK reads ``E2B_API_KEY``), prepare its repository, or kill it and raise."""
        if sdk is None:
            from e2b import AsyncSandbox as sdk  # the SDK is only needed when this backend is chosen
        options = options or E2BOptions.from_env()
        sandbox_id = sandbox_id or secrets.token_hex(8)
        kwargs = {
            **routing(metadata or {}, role, sandbox_id, options),
            **network_options(role, adapter_url),
            "timeout": options.lifetime_s,
            "idempotency_key": sandbox_id,
            **sdk_options,
        }
        creating = asyncio.ensure_future(with_retries(lambda: sdk.create(**kwargs), options))
        try:
            sbx = await asyncio.shield(creating)
        except asyncio.CancelledError:

            def kill_if_started(done: asyncio.Future[Any]) -> None:
                """A VM that starts after all must not leak: closed like any other (kill, retried)."""
                if done.cancelled() or done.exception() is not None:
                    return
                orphan = cls(done.result(), workdir=workdir, options=options, sandbox_id=sandbox_id)
                killing = asyncio.ensure_future(orphan.close())
                _orphan_kills.add(killing)
                killing.add_done_callback(_orphan_kills.discard)

            creating.add_done_callback(kill_if_started)
            raise
        except Exception as exc:
            raise SandboxError(f"E2B create failed: {exc}") from exc
        box = cls(sbx, workdir=workdir, options=options, sandbox_id=sandbox_id)
        try:
            setup = f"mkdir -p {shlex.quote(workdir)} {shlex.quote(options.run_dir)}"
            if role == "agent":
                setup += "; " + AGENT_REPO_SETUP.format(workdir=shlex.quote(workdir))
            await with_retries(lambda: sbx.commands.run(setup, timeout=300), options)
            if role == "agent":
                box.base_commit = await box._head()
        except BaseException as exc:  # the VM must not outlive a failed setup (nor a cancelled one)
            await box.close()
            if isinstance(exc, Exception):
                raise SandboxError(f"E2B sandbox {sandbox_id} setup failed: {exc}") from exc
            raise
        return box

    async def _head(self) -> str:
        """The repository's commit id, read right after it was made (an agent commit or reset cannot move
        the baseline recorded from it)."""
        done = await self.run(["git", "rev-parse", "--verify", "HEAD^{commit}"], GIT_ENV, timeout=300)
        sha = done.stdout.strip()
        if done.exit_code != 0 or not re.fullmatch(r"[0-9a-f]{40,64}", sha):
            raise SandboxError(f"no base commit in the VM: {done.stderr[-500:]}")
        return sha

    async def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        timeout: float = 600.0,
        *,
        agent: bool = False,
        secret_env: Mapping[str, str] | None = None,
    ) -> Completed:
        """``agent`` changes nothing here (no proxy stamps the agent's requests); ``secret_env`` joins the
        environment: the VM is the isolation and the agent owns all of it."""
        env = {**env, **(secret_env or {})}
        start = time.monotonic()
        files = f"{self.options.run_dir}/{next(self._runs)}"
        wrapper = (
            f"echo $$ > {files}.pgid; cd {shlex.quote(cwd or self.workdir)} && "
            f"{{ {shlex.join(cmd)}; }} > {files}.out 2> {files}.err; "
            f"echo $? > {files}.rc.tmp && mv {files}.rc.tmp {files}.rc"
        )
        # setsid: the command leads its own process group, so one kill takes everything it started.
        handle = await self._sbx.commands.run(
            f"setsid bash -c {shlex.quote(wrapper)}",
            background=True,
            envs=dict(env),
            cwd=cwd or self.workdir,
            timeout=0,
        )
        try:
            code = await asyncio.wait_for(self._poll(f"{files}.rc"), timeout)
            kind: FailureKind | None = None
        except TimeoutError:
            await self._kill(handle.pid, files)
            code, kind = KILLED_EXIT_CODE, "timeout"
        except BaseException:
            await asyncio.shield(self._kill(handle.pid, files))
            raise
        out, err = await self._output(f"{files}.out"), await self._output(f"{files}.err")
        dropped = out.dropped + err.dropped
        kind = kind or ("output_truncated" if dropped else None)
        return Completed(
            code, out.text(), err.text(), time.monotonic() - start, kind == "timeout", kind, dropped
        )

    async def _poll(self, rc_path: str) -> int:
        """Wait for the exit-code file; each read is retried on transient errors."""
        import e2b

        while True:
            try:
                text = await with_retries(lambda: self._sbx.files.read(rc_path), self.options)
                return int(str(text).strip() or -1)
            except e2b.NotFoundException:
                await asyncio.sleep(self.options.poll_s)

    async def _output(self, path: str) -> BoundedOutput:
        sink = BoundedOutput(self.options.output_bytes)
        try:
            sink.add(
                bytes(await with_retries(lambda: self._sbx.files.read(path, format="bytes"), self.options))
            )
        except Exception:  # noqa: BLE001 - a missing output file is empty output, not a failed run
            pass
        return sink

    async def _kill(self, pid: int, files: str) -> None:
        """SIGKILL the command's process group (its leader wrote its id), then the process (by the SDK)."""
        try:
            await self._sbx.commands.run(f"kill -9 -- -$(cat {files}.pgid) 2>/dev/null; true", timeout=30)
        except Exception:  # noqa: BLE001 - the SDK kill below is the fallback
            pass
        try:
            await self._sbx.commands.kill(pid)
        except Exception:  # noqa: BLE001 - already gone
            pass

    async def capture_patch(
        self, max_bytes: int, excluded: Sequence[str] = (), timeout: float = 300.0
    ) -> Captured:
        """The patch taken by git in the VM against the base commit recorded at boot, cut at ``max_bytes``
        there (``truncated`` when more existed). The agent owns the VM, its git and its object store, so it
        can forge this patch, but only into one it could have made by editing files: the grader applies it
        to a fresh sandbox and trusts nothing else from here. A VM or transport failure is a failed
        capture."""
        from rollbus.sandbox.capture import Captured, pathspec

        if self.base_commit is None:
            return Captured(b"", failure="git_failed", error="git diff: no base commit was recorded at boot")
        out = f"{self.options.run_dir}/patch.diff"
        script = DIFF_SCRIPT.format(
            w=shlex.quote(self.workdir), x=shlex.join(pathspec(excluded)), base=self.base_commit,
            out=shlex.quote(out), n=max_bytes,
        )  # fmt: skip
        try:
            done = await self.run(["bash", "-c", script], GIT_ENV, timeout=timeout)
            if done.timed_out:
                return Captured(b"", failure="timeout", error=done.stderr[-2000:])
            if done.exit_code != 0:
                error = f"git diff in the VM failed ({done.exit_code}): {done.stderr.strip()[-1500:]}"
                return Captured(b"", failure="git_failed", error=error)
            patch = await self.read_file(out)  # bytes: never decoded
            size = int((await self.read_file(f"{out}.size")).strip() or 0)
        except Exception as exc:  # noqa: BLE001 - the VM or its transport failed: a named kind, not a crash
            return Captured(b"", failure="sandbox_error", error=f"taking the patch from the VM: {exc!r}")
        return Captured(patch[:max_bytes], truncated=size > max_bytes)

    async def write_file(self, path: str, data: bytes | str) -> None:
        await with_retries(lambda: self._sbx.files.write(path, data), self.options)

    async def read_file(self, path: str) -> bytes:
        return bytes(await with_retries(lambda: self._sbx.files.read(path, format="bytes"), self.options))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await with_retries(lambda: self._sbx.kill(), self.options)
        except Exception:  # noqa: BLE001 - the VM's own lifetime (options.lifetime_s) ends it anyway
            pass


def vm_run_dir(sandbox: SandboxBase) -> str:
    """The backend's own directory in the VM (outside the workspace, so never in the patch)."""
    return str(getattr(getattr(sandbox, "options", None), "run_dir", RUN_DIR))
