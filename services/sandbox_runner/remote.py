"""E2B's placement (``--backend e2b``): a VM per attempt, the harness's CLI installed in it.

The attempt itself is the one flow of :mod:`rollout`; this module is what differs on E2B. Boot
(``create_sandbox(spec, "e2b")``, under the boot cap, retried; the VM records its base commit right after its
repository is made), install (for Claude Code, the Node 22 and CLI tarballs of the settings, as slime does:
node under ``--e2b-install-dir``/node, the CLI by ``npm install -g`` from its packed tarball, each skipped
when the template already answers ``node --version`` (22+) / ``claude --version``), and where the CLI runs:
its absolute path, the VM's PATH and the adapter's public URL. The patch is the backend's
(:meth:`rollbus.sandbox.e2b_backend.E2BSandbox.capture_patch`).

Threat model: the VM is the isolation and the agent owns all of it. The row (grading material, label) never
enters the VM: only the image and ``e2b_template`` go to the E2B API as routing metadata.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import lzma
import os
import re
import shlex
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from rollbus.sandbox import Completed, SandboxBase, SandboxSpec, create_sandbox
from rollbus.sandbox.bwrap_layout import WORKSPACE
from rollbus.sandbox.e2b_backend import vm_run_dir
from rollbus.services.sandbox_runner import outcome as kinds
from rollbus.services.sandbox_runner.harnesses import Harness, Where
from rollbus.services.sandbox_runner.rollout import AttemptFailed, RunnerKit, boot_retrying
from rollbus.services.sandbox_runner.settings import RunnerSettings

log = logging.getLogger("rollbus.sandbox_runner")
NODE_MAJOR = 22
DOWNLOAD_TIMEOUT_S = 600.0
_NODE_VERSION = re.compile(r"^v(\d+)\.")
# The VM's default user may not own the install dir's parent (/opt): make it through sudo then.
_MAKE_DIR = 'if ! mkdir -p {d} 2>/dev/null; then sudo -n install -d -o "$(id -u)" -g "$(id -g)" {d}; fi'
NODE_INSTALL = (
    "set -e; " + _MAKE_DIR + "; rm -rf {d}/node; mkdir -p {d}/node; "
    "tar xf {f} -C {d}/node --strip-components=1; rm -f {f}; {d}/node/bin/node --version"
)
# The CLI's packed tarball: a package whose bin is ``claude`` (cli.js), or the native platform package
# (``npm pack @anthropic-ai/claude-code-linux-x64@V``: no bin, its ``claude`` is the binary, linked here). The
# 2.x wrapper alone does not work offline: its binary comes from an optional dependency npm cannot fetch.
CLI_INSTALL = (
    "set -e; " + _MAKE_DIR + "; mkdir -p {d}/cli; "
    "npm install -g --prefix {d}/cli --offline --no-audit --no-fund --loglevel=error {f}; rm -f {f}; "
    "if ! claude --version > /dev/null 2>&1; then "
    "for native in {d}/cli/lib/node_modules/@anthropic-ai/claude-code-linux-*/claude; do "
    '[ -x "$native" ] && mkdir -p {d}/cli/bin && ln -sf "$native" {d}/cli/bin/claude && break; done; fi; '
    "claude --version"
)


@dataclass
class Tarballs:
    """The two host-side tarballs, fetched (URLs) and made plain (``.xz``) once per runner."""

    settings: RunnerSettings
    _ready: tuple[Path, Path] | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def paths(self) -> tuple[Path, Path]:
        async with self._lock:
            if self._ready is None:
                self._ready = await asyncio.to_thread(self._prepare)
            return self._ready

    def _prepare(self) -> tuple[Path, Path]:
        cache = self.settings.state_dir / "e2b-agent"
        cache.mkdir(parents=True, exist_ok=True)
        assert self.settings.node_tarball and self.settings.claude_code_tarball  # settings check this
        node = plain_tar(host_file(self.settings.node_tarball, cache), cache)
        return node, host_file(self.settings.claude_code_tarball, cache)


def host_file(source: str, cache: Path) -> Path:
    """A tarball named by path or URL, as a host file (a URL downloaded once into ``cache``)."""
    if not source.startswith(("http://", "https://")):
        return Path(source)
    name = Path(urlsplit(source).path).name or "download"
    dest = cache / f"{hashlib.sha256(source.encode()).hexdigest()[:16]}-{name}"
    if not dest.is_file():
        partial = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}.partial")  # runners may share it
        with httpx.stream("GET", source, follow_redirects=True, timeout=DOWNLOAD_TIMEOUT_S) as answer:
            answer.raise_for_status()
            with partial.open("wb") as out:
                for chunk in answer.iter_bytes():
                    out.write(chunk)
        os.replace(partial, dest)
    return dest


def plain_tar(path: Path, cache: Path) -> Path:
    """``.xz`` decompressed on the host (once), as slime does, so a VM without xz-utils still untars it."""
    if path.suffix != ".xz":
        return path
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = cache / f"{key}-{path.stem}"
    if not dest.is_file():
        partial = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:8]}.partial")  # runners may share it
        with lzma.open(path, "rb") as src, partial.open("wb") as out:
            shutil.copyfileobj(src, out)
        os.replace(partial, dest)
    return dest


def agent_path(settings: RunnerSettings) -> str:
    """The VM's PATH: what we install first, then the template's own."""
    d = settings.e2b_install_dir.rstrip("/")
    return f"{d}/cli/bin:{d}/node/bin:{settings.e2b_path}"


def remote_spec(settings: RunnerSettings, metadata: dict[str, Any], sandbox_id: str) -> SandboxSpec:
    """The agent's VM: the image (a template routing key, not a host path) and the adapter's public URL."""
    env = info if isinstance(info := metadata.get("remote_env_info"), dict) else {}
    image = metadata.get("image") or env.get("image")
    if not isinstance(image, str) or not image:
        raise AttemptFailed(kinds.BAD_TASK, "the task's metadata names no image")
    routing = {"image": image}
    if isinstance(metadata.get("e2b_template"), str):
        routing["e2b_template"] = metadata["e2b_template"]
    return SandboxSpec(
        image=Path(image), role="agent", workdir=str(metadata.get("workdir") or WORKSPACE),
        limits=settings.limits(), adapter_url=settings.e2b_base_url(), metadata=routing,
        sandbox_id=sandbox_id,
    )  # fmt: skip


class Installed:
    """E2B: a VM from the row's template; the harness's CLI installed in it (unless the template has it)."""

    async def boot(
        self, kit: RunnerKit, metadata: dict[str, Any], attempt_id: str, harness: Harness
    ) -> SandboxBase:
        if not harness.installs_in_vm:
            raise AttemptFailed(kinds.BAD_TASK, f"the e2b backend does not run the {harness.name} agent")
        return await boot(kit, remote_spec(kit.settings, metadata, attempt_id))

    async def place(self, kit: RunnerKit, sandbox: SandboxBase, harness: Harness) -> Where:
        binary = await harness.install_in_vm(kit, sandbox)
        settings = kit.settings
        return Where(settings.e2b_base_url(), sandbox.home, sandbox.workdir, binary, agent_path(settings))


async def boot(kit: RunnerKit, spec: SandboxSpec) -> SandboxBase:
    """A VM under the boot cap; a failed boot (already killed by the backend) is retried with a new id."""

    async def start(n: int) -> SandboxBase:
        one = dataclasses.replace(spec, sandbox_id=f"{spec.sandbox_id}-{n}")
        return await create_sandbox(one, "e2b", options=kit.e2b_options, sdk=kit.sdk)

    return await boot_retrying(kit, start, " (e2b; memory, pids, CPU and disk are the template's)")


async def install(kit: RunnerKit, sandbox: SandboxBase) -> str:
    """Node 22 and the CLI in the VM, unless its template has them; the CLI's absolute path.

    Every step sets PATH itself (a login shell in the VM may reset the one we pass); any failure is
    ``install_failed``.
    """
    settings = kit.settings
    d, step = shlex.quote(settings.e2b_install_dir.rstrip("/")), settings.e2b_step_timeout
    run_dir = vm_run_dir(sandbox)
    env = {"PATH": agent_path(settings), "HOME": sandbox.home, "npm_config_cache": f"{run_dir}/npm-cache"}

    async def shell(script: str) -> Completed:
        line = f"export PATH={shlex.quote(agent_path(settings))}; {script}"
        return await sandbox.run(["bash", "-c", line], env, timeout=step)

    try:
        node_ok = node_major(await shell("node --version")) >= NODE_MAJOR
        cli_ok = ok(await shell("claude --version"))
        if not (node_ok and cli_ok):
            kit.tarballs = kit.tarballs or Tarballs(settings)
            node, cli = await kit.tarballs.paths()
            steps = [("node.tar", node, NODE_INSTALL)] if not node_ok else []
            steps += [("claude-code.tgz", cli, CLI_INSTALL)] if not cli_ok else []
            for name, host, script in steps:
                inside = f"{run_dir}/{name}"
                await sandbox.write_file(inside, await asyncio.to_thread(host.read_bytes))
                done = await shell(script.format(d=d, f=shlex.quote(inside)))
                if not ok(done):
                    why = "timed out" if done.timed_out else f"exited {done.exit_code}"
                    raise AttemptFailed(
                        kinds.INSTALL_FAILED, f"installing {name} {why}: {done.stderr.strip()[-1500:]}"
                    )
        found = await shell("command -v claude")
        binary = found.stdout.strip()
        if not ok(found) or not binary.startswith("/"):
            raise AttemptFailed(kinds.INSTALL_FAILED, "claude is not on the VM's PATH after the install")
        return binary
    except AttemptFailed:
        raise
    except Exception as exc:  # a missing/unreachable tarball, a failed upload: the attempt, not the runner
        raise AttemptFailed(kinds.INSTALL_FAILED, f"{type(exc).__name__}: {exc}") from exc


def ok(done: Completed) -> bool:
    return done.exit_code == 0 and not done.timed_out


def node_major(done: Completed) -> int:
    match = _NODE_VERSION.match(done.stdout.strip())
    return int(match.group(1)) if ok(done) and match else 0
