"""The grader's ``docker`` backend: every command of a grade in a fresh container of the row's image.

The image is the diff's ``image_digest`` (the bytes the agent ran) where the diff names one, else the row's
``metadata.image`` (a container reference); a row whose image is a host path (a repository directory or
tarball) is graded in containers of the project's Debian base image (:mod:`rollbus.sandbox.docker_images`).
The grade is :mod:`rollbus.grading.run`'s, step for step; only where its commands run differs:

- the base tree is the image's ``workdir`` copied out of it (nothing of the image runs), made into the
  scrubbed base repository on the host as for bwrap;
- each sandbox is a :class:`~rollbus.sandbox.docker_backend.DockerSandbox` of the image's id over the tree
  the host prepared: bind-mounted where only ``git apply`` (or a Harbor gold ``solve.sh``) writes it and the
  host reads it back; copied into an engine-made tmpfs volume of the grade's disk cap (the smaller of the
  row's disk limit and ``scratch_bytes``) where the code under test runs (``copy_tree``), so what it writes
  is capped by the engine wherever the grader runs (Compose included), and read back through the engine
  (reports, the tree's code files); HOME likewise a capped volume; ``network_mode=none``, an unprivileged
  uid, no capabilities, no new privileges, the image's root read-only, limits on pids, memory, CPU and
  ``/tmp``, the eval material and the protected test directories read-only; commands run with the image's
  own ``PATH`` (a SWE-bench image's environment);
- the report channel is :class:`~rollbus.grading.channel.SocketChannel`: a socket file in a host directory
  bind-mounted alone at :data:`CHANNEL_DIR`, accepted once (the grader's launcher, run as the command before
  any repository code) and removed, so the tested code finds the same inherited descriptors as under bwrap
  and nothing of the grader's in its environment or files.

A Harbor task (:class:`~rollbus.grading.rows.Harbor`) is graded its own way (:mod:`.harbor`). The result's
``details["image_digest"]`` names the image the grade ran in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollbus.grading import run, second_run, verdict
from rollbus.grading.channel import SOCKET_NAME, SocketChannel
from rollbus.grading.rows import GradingSpec, Harbor
from rollbus.grading.verdict import GradeResult, failed
from rollbus.sandbox.base import Completed, SandboxError
from rollbus.sandbox.limits import Limits
from rollbus.task_image import row_limits

CHANNEL_DIR = "/run/rollbus-grader"  # where the channel's socket directory is mounted in a test container
LAUNCH = (  # the launcher where the image has a python3; the bare command (reporting nothing) where not
    "sh", "-c", 'command -v python3 >/dev/null 2>&1 && exec python3 -I -S "$0" "$@"; shift; exec "$@"',
    f"{run.PLUGIN_DIR}/rollbus_launch.py", f"{CHANNEL_DIR}/{SOCKET_NAME}",
)  # fmt: skip
LIMITS = Limits()  # bwrap's grading defaults; the disk: the tree's and HOME's volumes (under scratch_bytes)


async def grade(spec: GradingSpec, patch: bytes | str, config: run.GradeConfig | None = None) -> GradeResult:
    """Grade ``patch`` against ``spec`` in containers (:func:`rollbus.grading.run.grade`'s contract)."""
    try:
        client, image = await asyncio.to_thread(_image, spec)
    except SandboxError as exc:
        kind = verdict.SANDBOX_FAILED
        return failed(kind, str(exc))
    limits = row_limits(LIMITS, {"resources": spec.resources}) if spec.resources else LIMITS
    cap = (config or run.GradeConfig()).scratch_bytes
    if limits.disk_bytes is not None and cap < limits.disk_bytes:  # the tree's volume: the grade's scratch's
        limits = dataclasses.replace(limits, disk_bytes=cap)
    sandboxes = ContainerSandboxes(client, image.id, _path_of(image), limits)
    if isinstance(spec.grader, Harbor):
        from rollbus.grading.harbor import grade_harbor

        result = await grade_harbor(spec, patch, config or run.GradeConfig(), sandboxes)
    else:
        result = await run.grade_in(sandboxes, spec, patch, config)
    return dataclasses.replace(result, details={**result.details, "image_digest": image.id})


def _image(spec: GradingSpec) -> tuple[Any, Any]:
    """The engine and the image the grade runs in (its digest first, then the row's reference)."""
    import docker

    from rollbus.sandbox import docker_engine, docker_images

    try:
        client = docker_engine.client()
    except docker_engine.EngineUnavailable as exc:
        raise SandboxError(f"docker: {exc}") from exc
    try:
        if spec.image_digest is not None:
            return client, client.images.get(spec.image_digest)
        if spec.container_image is not None:
            if isinstance(spec.grader, Harbor):
                docker_images.ensure_harbor_image(client, spec.grader.task_dir, spec.grader.settings)
            return client, client.images.get(spec.container_image)
        return client, client.images.get(docker_images.ensure_base_image(client))
    except docker.errors.ImageNotFound as exc:
        which = spec.image_digest or spec.container_image
        raise SandboxError(f"no image {which!r} in the Docker engine (build or load it first)") from exc
    except (docker.errors.DockerException, docker_images.ImageBuildError) as exc:
        raise SandboxError(f"docker: {exc}") from exc


def _path_of(image: Any) -> str | None:
    for item in (image.attrs.get("Config") or {}).get("Env") or []:
        if item.startswith("PATH="):
            return item.removeprefix("PATH=")
    return None


class ContainerSandboxes:
    """:class:`rollbus.grading.run.Sandboxes` over one image of one engine."""

    def __init__(self, client: Any, image: str, path: str | None, limits: Limits = LIMITS) -> None:
        self.client, self.image, self.path, self.limits = client, image, path, limits

    def refusal(self, spec: GradingSpec) -> GradeResult | None:
        return None

    async def tree(self, spec: GradingSpec, dest: Path) -> Path:
        """The image's ``workdir`` (a container row's), else the row's host tree."""
        if spec.container_image is None:
            return run.materialize(spec.image, dest)
        from rollbus.sandbox.docker_images import export_tree

        return await asyncio.to_thread(export_tree, self.client, self.image, spec.workdir, dest)

    async def sandbox(
        self,
        repo: Path,
        workdir: str,
        binds: Mapping[Path, str],
        channel: run.ReportChannel | None = None,
        *,
        rw_binds: Mapping[Path, str] | None = None,
        user: str | None = None,
        copy_tree: bool = False,
    ) -> GradingContainer:
        """``copy_tree``: the code under test runs here, so ``repo`` goes into the sandbox's capped volume
        (with a disk limit) and is left on the host as it was, and each ``rw_binds`` path is an empty capped
        volume instead of its host directory: read what the run wrote through the sandbox."""
        from rollbus.sandbox.docker_backend import DockerSandbox

        ro = {str(host): inside for host, inside in binds.items()}
        if isinstance(channel, SocketChannel):
            ro[channel.directory] = CHANNEL_DIR
        # HOME and the sandbox's other host files beside the tree, on the grade's scratch: one directory the
        # engine must resolve (under Compose, the grader's scratch dir in the directory shared with it)
        box = await DockerSandbox.create(
            self.image, client=self.client, workdir=workdir, limits=self.limits, ro_binds=ro,
            workspace=repo, rw_binds={str(h): i for h, i in (rw_binds or {}).items()},
            scratch_root=repo.parent, user=user, copy_workspace=copy_tree,
        )  # fmt: skip
        return GradingContainer(box, self.path, isinstance(channel, SocketChannel))

    def channel(self, config: Mapping[str, Any], scratch: Path) -> SocketChannel:
        return SocketChannel(config, tempfile.mkdtemp(prefix="channel-", dir=scratch))


class GradingContainer:
    """A grading command container: the image's ``PATH``, and each command started by the launcher where
    the sandbox carries a channel."""

    def __init__(self, box: Any, path: str | None, launched: bool) -> None:
        self.box, self.path, self.launched = box, path, launched
        self.workdir, self.home, self.owner = box.workdir, box.home, box.owner

    async def run(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        timeout: float = 600.0,
        *,
        pass_fds: Sequence[int] = (),
    ) -> Completed:
        env = {**env, "PATH": self.path} if self.path else dict(env)
        argv = [*LAUNCH, *cmd] if self.launched else list(cmd)
        return await self.box.run(argv, env, cwd, timeout, pass_fds=pass_fds)

    async def write_file(self, path: str, data: bytes | str) -> None:
        await self.box.write_file(path, data)

    async def read_file(self, path: str, limit: int | None = None) -> bytes:
        return await self.box.read_file(path, limit)

    @property
    def tree_copied(self) -> bool:
        """The tree (and the writable directories) are the sandbox's own capped volumes: read them through
        :meth:`code_files` and :meth:`read_file`, not on the host."""
        return bool(self.box.workspace_copied)

    async def code_files(self) -> dict[str, tuple[str, int, str]]:
        """:func:`rollbus.grading.second_run.code_files` of the sandbox's copy of the tree, through the
        engine: each code file's kind, size and content digest."""
        return await self.box.tree_digests(second_run.is_code)

    async def close(self) -> None:
        await self.box.close()
