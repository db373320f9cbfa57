"""What a sandbox should be (:class:`SandboxSpec`) and the local backend's factory (:func:`create_local`).

The spec is backend-neutral: the image, the role, the limits, how the agent reaches the adapter and the row's
metadata (the E2B backend routes templates by it). ``create_local`` builds a :class:`BwrapSandbox` from it:
the workspace (history-free for the agent, the full image for the grader), the trusted diff baseline beside
it (never mounted), the adapter proxy socket, and kills and removes all of it if any step fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from rollbus.sandbox.adapter_proxy import AdapterProxy
from rollbus.sandbox.base import Network, SandboxBase, SandboxError, SandboxUnavailable
from rollbus.sandbox.bwrap import TMP_MEASURED, BwrapSandbox
from rollbus.sandbox.bwrap_host import (
    OWNER_FILE,
    SCRATCH_ROOT,
    bwrap_supports,
    mount_tmpfs,
    remove_scratch,
    unmount,
)
from rollbus.sandbox.bwrap_layout import WORKSPACE
from rollbus.sandbox.e2b_backend import E2B_WORKSPACE
from rollbus.sandbox.images import cached_agent_workspace, grader_workspace, unpack
from rollbus.sandbox.limits import CGROUP_ROOT, Cgroups, Limits, enforcement
from rollbus.sandbox.netns import private_netns
from rollbus.sandbox.repo import record_baseline

Role = Literal["agent", "grader"]


@dataclass(frozen=True)
class SandboxSpec:
    """One sandbox to make. ``image``/``toolchain`` are host paths (see :func:`images.resolve_image`)."""

    image: Path
    role: Role = "agent"
    workdir: str = WORKSPACE  # where the repository appears inside
    limits: Limits = field(default_factory=Limits)
    adapter_url: str | None = None  # agent: the adapter's host address (http://127.0.0.1:8000)
    base_url: str | None = None  # agent: ANTHROPIC_BASE_URL as the agent sees it (its port is forwarded)
    toolchain: Path | None = None  # root filesystem (dir or tarball); None: the host's read-only /usr
    ro_binds: Mapping[str, str] = field(default_factory=dict)  # host path -> inside path (the CLI binary)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    sandbox_id: str | None = None
    container_image: str | None = None  # a container image reference (a container backend's; not bwrap's)
    user: str | None = None  # the OS user the agent runs as, where the backend can honour it (containers)

    @property
    def network(self) -> Network:
        """Graders never get a network; agents get the adapter only (or nothing without one)."""
        return "adapter" if self.role == "agent" and self.adapter_url else "none"

    @property
    def forward_port(self) -> int | None:
        if self.base_url is None:
            return None
        parts = urlsplit(self.base_url)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the agent's base URL must be on loopback, got {self.base_url!r}")
        return parts.port or 80


async def create_local(spec: SandboxSpec, *, scratch_root: Path = SCRATCH_ROOT) -> BwrapSandbox:
    """Make the bwrap sandbox ``spec`` describes; on any failure nothing is left behind.

    As root an agent sandbox gets a network namespace of its own made here, with the adapter proxy listening
    on its loopback port (:mod:`rollbus.sandbox.netns`); otherwise a forwarder inside reaches the proxy's
    unix socket.
    """
    if spec.container_image is not None:
        raise SandboxError(
            f"image {spec.container_image!r} is a container image: the local (bwrap) backend runs host "
            "repository directories and tarballs only (choose a container backend)",
            "image_error",
        )
    sandbox_id = spec.sandbox_id or secrets.token_hex(8)
    data = scratch_root / f"{sandbox_id}.data"
    data.mkdir(parents=True, mode=0o700)
    (data / OWNER_FILE).write_text(str(os.getpid()))
    box: BwrapSandbox | None = None
    disk = False
    netns: int | None = None
    listener: socket.socket | None = None
    try:
        if spec.network == "adapter" and os.geteuid() == 0:
            assert spec.forward_port is not None
            netns, listener = await private_netns(spec.forward_port)
        disk = mount_disk(data / "ws", spec.limits.disk_bytes)
        workspace = await asyncio.to_thread(_workspace, spec, scratch_root, data / "ws")
        toolchain = None
        if spec.toolchain is not None:
            toolchain = await asyncio.to_thread(
                unpack, spec.toolchain, scratch_root / "images", repository=False
            )
        box = await BwrapSandbox.create(
            workspace,
            network=spec.network,
            ro_binds=spec.ro_binds,
            limits=spec.limits,
            adapter_socket=data / "adapter.sock" if spec.network == "adapter" and netns is None else None,
            forward_port=spec.forward_port if spec.network == "adapter" else None,
            netns=netns,
            sandbox_id=sandbox_id,
            toolchain=toolchain,
            scratch_root=scratch_root,
            inside_workdir=spec.workdir,
        )
        box.on_close(lambda: asyncio.to_thread(_remove_data, data, disk))
        if spec.network == "adapter":
            assert spec.adapter_url is not None
            path = None if listener is not None else data / "adapter.sock"
            box.proxy = AdapterProxy(
                path, spec.adapter_url, sandbox_id, owner=box.host_uid, listener=listener
            )
            listener = None  # the proxy owns it now
            box.on_close(box.proxy.close)
            await box.proxy.start()
        return box
    except BaseException as exc:
        if box is not None:
            await box.close()
        if disk and box is None:
            unmount(data / "ws")
        shutil.rmtree(data, ignore_errors=True)
        if listener is not None:
            listener.close()
        if isinstance(exc, SandboxUnavailable | OSError):
            raise SandboxError(f"cannot create sandbox {sandbox_id}: {exc}") from exc
        raise
    finally:
        if netns is not None:
            os.close(netns)  # the sandbox keeps its own duplicate


async def create_sandbox(spec: SandboxSpec, backend: str = "local", **options: Any) -> SandboxBase:
    """The sandbox ``spec`` describes on ``backend`` (``local``/``bwrap``: bwrap; ``docker``: a container of
    the task's own image; ``e2b``: a cloud VM).

    On E2B the agent reaches the adapter at ``spec.adapter_url`` directly (no forwarder); ``options`` go to
    the backend's factory (``scratch_root`` for local, ``options``/``sdk`` for E2B).
    """
    if backend in ("local", "bwrap"):
        return await create_local(spec, **options)
    if backend == "e2b":
        from rollbus.sandbox.e2b_backend import E2BSandbox

        metadata = {"image": str(spec.image), **spec.metadata}
        return await E2BSandbox.create(
            role=spec.role,
            metadata=metadata,
            adapter_url=spec.adapter_url,
            workdir=spec.workdir if spec.workdir != WORKSPACE else E2B_WORKSPACE,
            sandbox_id=spec.sandbox_id,
            **options,
        )
    if backend == "docker":
        return await create_docker(spec, **options)
    raise ValueError(f"unknown sandbox backend {backend!r} (local, docker, e2b)")


async def create_docker(spec: SandboxSpec, **options: Any) -> SandboxBase:
    """The docker sandbox ``spec`` describes: ``spec.image`` names a container image the engine has, its
    ``workdir`` the repository inside it (history scrubbed to the base commit), ``metadata.user`` the uid the
    agent runs as (default 1000:1000); ``options`` go to :meth:`DockerSandbox.create` (``client``,
    ``scratch_root``)."""
    from rollbus.sandbox.docker_backend import DockerSandbox

    harbor = spec.metadata.get("harbor")
    if isinstance(harbor, dict) and harbor.get("build_image"):  # a Harbor task: environment/ built here
        await _harbor_image(harbor, options.get("client"))
    user = spec.user or spec.metadata.get("user")
    image = spec.container_image or await _tree_image(spec.image, spec.workdir, options.get("client"))
    return await DockerSandbox.create(
        image, workdir=spec.workdir, limits=spec.limits,
        ro_binds=spec.ro_binds,
        network=spec.network, adapter_url=spec.adapter_url,
        forward_port=spec.forward_port if spec.network == "adapter" else None,
        user=str(user) if user else None, sandbox_id=spec.sandbox_id, **options,
    )  # fmt: skip


async def _tree_image(tree: Path, workdir: str, client: Any) -> str:
    """A path row's image on the docker backend: the base image with the row's tree at its workdir."""
    from rollbus.sandbox import docker_engine, docker_images

    try:
        client = client or await asyncio.to_thread(docker_engine.client)
        return await asyncio.to_thread(docker_images.ensure_tree_image, client, Path(tree), workdir)
    except (docker_engine.EngineUnavailable, docker_images.ImageBuildError) as exc:
        raise SandboxError(f"docker: {exc}", "image_error") from exc


async def _harbor_image(harbor: dict[str, Any], client: Any) -> None:
    from rollbus.sandbox import docker_engine, docker_images

    try:
        client = client or await asyncio.to_thread(docker_engine.client)
        await asyncio.to_thread(
            docker_images.ensure_harbor_image, client, Path(str(harbor.get("task_dir"))), harbor
        )
    except (docker_engine.EngineUnavailable, docker_images.ImageBuildError) as exc:
        raise SandboxError(f"the Harbor task's image: {exc}", "image_error") from exc


def probe_enforcement(limits: Limits) -> dict[str, str]:
    """Which limits a local sandbox would enforce here, for a service's start-up log (makes no sandbox)."""
    cgroups = Cgroups.create(f"rollbus-probe-{secrets.token_hex(4)}", limits)
    try:
        disk = "tmpfs size (workspace and HOME)" if os.geteuid() == 0 else "checked after each command (du)"
        report = enforcement(limits, cgroups, disk)
        if os.geteuid() == 0 and limits.tmp_bytes is not None:
            report["tmp"] = TMP_MEASURED
    finally:
        if cgroups is not None:
            cgroups.destroy()
    report["nested_userns"] = (
        "bwrap --disable-userns" if bwrap_supports("--disable-userns") else "NOT blocked"
    )
    report["identity"] = "per-sandbox host uid" if os.geteuid() == 0 else f"caller uid {os.getuid()}"
    report["network"] = "own namespace, " + (
        "the adapter proxy listens inside" if os.geteuid() == 0 else "socat to the adapter socket"
    )
    return report


def mount_disk(path: Path, size: int | None) -> bool:
    """A size-capped tmpfs for the workspace (as root only; elsewhere the cap is checked after each command).

    The trusted baseline stays beside it, on the host filesystem: an agent that fills its disk cannot stop
    the patch from being captured. Its pages count against the sandbox's memory cgroup once written.
    """
    if size is None or os.geteuid() != 0:
        return False
    path.mkdir(mode=0o700)
    if not mount_tmpfs(path, 0o755, size, name="rollbus-disk"):
        path.rmdir()
        return False
    return True


def sweep_stale(scratch_root: Path = SCRATCH_ROOT) -> list[str]:
    """Remove what sandboxes of dead processes left (runner killed -9): mounts, cgroups, directories.

    Each local sandbox records its owner's pid; a runner calls this at start-up. Returns the swept ids.
    """
    swept: list[str] = []
    for owner in sorted(scratch_root.glob(f"*/{OWNER_FILE}")):
        with contextlib.suppress(ValueError, OSError):
            if Path(f"/proc/{int(owner.read_text())}").exists():
                continue
        sandbox_id = owner.parent.name.removesuffix(".data")
        if sandbox_id in swept:
            continue
        data = scratch_root / f"{sandbox_id}.data"
        if os.path.ismount(data / "ws"):
            unmount(data / "ws")
        for cgroup in [*CGROUP_ROOT.glob(f"*/rollbus-{sandbox_id}"), CGROUP_ROOT / f"rollbus-{sandbox_id}"]:
            with contextlib.suppress(OSError):
                cgroup.rmdir()
        remove_scratch(scratch_root / sandbox_id)
        shutil.rmtree(data, ignore_errors=True)
        swept.append(sandbox_id)
    return swept


def _remove_data(data: Path, disk: bool) -> None:
    """The workspace mount, then the data dir (baseline included); run off the event loop at close."""
    if disk:
        unmount(data / "ws")
    shutil.rmtree(data, ignore_errors=True)


def _workspace(spec: SandboxSpec, scratch_root: Path, dest: Path) -> Path:
    src = unpack(Path(spec.image), scratch_root / "images", repository=True)
    if spec.role == "agent":
        made = cached_agent_workspace(src, dest, scratch_root / "images")
    else:
        made = record_baseline(grader_workspace(src, dest))
    os.chmod(dest.parent, 0o700)
    return made
