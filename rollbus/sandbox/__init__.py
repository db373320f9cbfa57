"""Fresh, disposable sandboxes for coding agents, behind one small interface (:class:`Sandbox`).

Backends: :class:`BwrapSandbox` (Linux namespaces, the default), :class:`LocalSubprocessSandbox` (fallback,
weak) and :class:`E2BSandbox` (cloud VMs). :func:`prepare_repo`, :func:`git_diff` and :func:`apply_patch`
handle the repository on the host side.
"""

from rollbus.sandbox.base import Completed, Network, Sandbox, SandboxPathError
from rollbus.sandbox.bwrap import BwrapSandbox, SandboxUnavailable, bwrap_usable
from rollbus.sandbox.e2b_backend import E2BSandbox
from rollbus.sandbox.local import LocalSubprocessSandbox
from rollbus.sandbox.repo import GitError, apply_patch, baseline_gitdir, git_diff, prepare_repo

__all__ = [
    "BwrapSandbox",
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
