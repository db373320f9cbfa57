"""Fresh, disposable sandboxes for coding agents, behind one small contract (:mod:`rollbus.sandbox.base`).

:func:`create_local` makes a local sandbox from a :class:`SandboxSpec`. Backends: :class:`BwrapSandbox`
(Linux namespaces, the default), :class:`LocalSubprocessSandbox` (fallback, weak) and :class:`E2BSandbox`
(cloud VMs). :func:`prepare_repo`, :func:`git_diff` and :func:`apply_patch` handle the repository on the
host side; :class:`AdapterProxy` is the host side of an agent's only way out.
"""

from rollbus.sandbox.adapter_proxy import SANDBOX_HEADER, AdapterProxy
from rollbus.sandbox.base import (
    Completed,
    FailureKind,
    Network,
    Sandbox,
    SandboxBase,
    SandboxError,
    SandboxPathError,
    SandboxUnavailable,
)
from rollbus.sandbox.bwrap import BwrapSandbox, bwrap_usable
from rollbus.sandbox.e2b_backend import E2BSandbox
from rollbus.sandbox.images import resolve_image
from rollbus.sandbox.limits import Limits
from rollbus.sandbox.local import LocalSubprocessSandbox
from rollbus.sandbox.repo import GitError, apply_patch, baseline_gitdir, git_diff, prepare_repo
from rollbus.sandbox.spec import SandboxSpec, create_local, create_sandbox, probe_enforcement, sweep_stale

__all__ = [
    "SANDBOX_HEADER",
    "AdapterProxy",
    "BwrapSandbox",
    "FailureKind",
    "Limits",
    "SandboxBase",
    "SandboxError",
    "SandboxSpec",
    "create_local",
    "create_sandbox",
    "probe_enforcement",
    "sweep_stale",
    "resolve_image",
    "Completed",
    "E2BSandbox",
    "GitError",
    "LocalSubprocessSandbox",
    "Network",
    "Sandbox",
    "SandboxPathError",
    "SandboxUnavailable",
    "apply_patch",
    "baseline_gitdir",
    "bwrap_usable",
    "git_diff",
    "prepare_repo",
]
