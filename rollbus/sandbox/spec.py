"""What a sandbox should be (:class:`SandboxSpec`) and the local backend's factory (:func:`create_local`).

The spec is backend-neutral: the image, the role, the limits, how the agent reaches the adapter and the row's
metadata (the E2B backend routes templates by it). ``create_local`` builds a :class:`BwrapSandbox` from it:
the workspace (history-free for the agent, the full image for the grader), the trusted diff baseline beside
it (never mounted), the adapter proxy socket, and kills and removes all of it if any step fails.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from rollbus.sandbox.adapter_proxy import AdapterProxy
from rollbus.sandbox.base import Network, SandboxError
from rollbus.sandbox.bwrap import SCRATCH_ROOT, WORKSPACE, BwrapSandbox, SandboxUnavailable
from rollbus.sandbox.images import agent_workspace, grader_workspace, unpack
from rollbus.sandbox.limits import Limits
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
    """Make the bwrap sandbox ``spec`` describes; on any failure nothing is left behind."""
    sandbox_id = spec.sandbox_id or secrets.token_hex(8)
    data = scratch_root / f"{sandbox_id}.data"
    data.mkdir(parents=True, mode=0o700)
    proxy: AdapterProxy | None = None
    box: BwrapSandbox | None = None
    try:
        workspace = await asyncio.to_thread(_workspace, spec, scratch_root, data / "ws")
        toolchain = None
        if spec.toolchain is not None:
            toolchain = await asyncio.to_thread(
                unpack, spec.toolchain, scratch_root / "images", repository=False
            )
        box = BwrapSandbox(
            workspace,
            network=spec.network,
            ro_binds=spec.ro_binds,
            limits=spec.limits,
            adapter_socket=data / "adapter.sock" if spec.network == "adapter" else None,
            forward_port=spec.forward_port if spec.network == "adapter" else None,
            sandbox_id=sandbox_id,
            toolchain=toolchain,
            scratch_root=scratch_root,
            inside_workdir=spec.workdir,
        )
        box.on_close(lambda: shutil.rmtree(data, ignore_errors=True))
        if spec.network == "adapter":
            assert spec.adapter_url is not None
            proxy = AdapterProxy(data / "adapter.sock", spec.adapter_url, sandbox_id, owner=box.host_uid)
            await proxy.start()
            box.on_close(proxy.close)
            box.proxy = proxy
        return box
    except BaseException as exc:
        if box is not None:
            await box.close()
        elif proxy is not None:
            await proxy.close()
        shutil.rmtree(data, ignore_errors=True)
        if isinstance(exc, SandboxUnavailable | OSError):
            raise SandboxError(f"cannot create sandbox {sandbox_id}: {exc}") from exc
        raise


def _workspace(spec: SandboxSpec, scratch_root: Path, dest: Path) -> Path:
    src = unpack(Path(spec.image), scratch_root / "images", repository=True)
    made = agent_workspace(src, dest) if spec.role == "agent" else grader_workspace(src, dest)
    record_baseline(made)
    os.chmod(dest.parent, 0o700)
    return made
