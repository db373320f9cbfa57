"""A docker sandbox's capped disk, made by the engine: fixed-size tmpfs volumes its command container holds.

A tmpfs the runner mounts on a host directory caps the disk only where the engine sees the runner's mounts.
Under Compose the runner is a container beside the engine and its mounts are private to it: a bind of that
directory gives the sandbox the plain host disk beneath. So the engine makes the filesystem itself: a
``local`` volume with ``type=tmpfs`` and ``o=size=N`` (per sandbox, one for the workspace, one for HOME),
mounted by every container of the sandbox. A write past ``N`` fails while it is written (ENOSPC inside the
container); nothing reaches the host disk, whoever started the container and wherever it runs.

The engine mounts such a volume while some container uses it and drops its contents when none does, so the
sandbox's command container holds it for the sandbox's whole life: it is started once, before the workspace
goes in, and never restarted (a deadline kills the command's processes, not the container; see
:mod:`rollbus.sandbox.docker_backend`). Its init and that init's sleeping child run with no capability as uid
0, or 65534 where the commands run as uid 0 (:func:`init_user`: never the commands' uid, so no command can
signal them; uid 0 lets any root caller read their ``/proc/<pid>/root``) and are never the memory cgroup's OOM
victim (``oom_score_adj`` -1000, set by the host). The host never touches the files directly: the workspace
goes in, and the runner's files come and go, through the engine's archive API on that container
(``put_archive`` / ``get_archive``: the engine resolves paths inside it, so a link the agent planted cannot
reach a host path). The patch is taken as before, by a tool container mounting the workspace volume read-only.
Free space (for ``disk_full``) is read through the holding container's ``/proc/<pid>/root`` where the host
sees its pids (the runner under Compose has the host's pid namespace).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import posixpath
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbus.sandbox.base import FailureKind, SandboxError, SandboxPathError

START_TRIES = 3  # a container start the engine failed (a server error) is tried again
INIT_USER = "0:0"  # the holder's init: no capability; root, so a root caller reads its /proc/<pid>/root
INIT_USER_BESIDE_ROOT = "65534:65534"  # where the commands run as uid 0, which could signal a uid-0 init


@dataclass(frozen=True)
class EngineDisk:
    """One sandbox's capped volumes (sandbox path -> volume name) and the container that holds them mounted
    (``keeper``: the sandbox's command container, its init's host pid; empty until it started)."""

    volumes: Mapping[str, str]
    size: int
    keeper: str = ""
    keeper_pid: int = 0

    def free_paths(self) -> list[Path]:
        """Where the host reads each volume's free space (empty where it cannot see the holder's pids)."""
        root = Path(f"/proc/{self.keeper_pid}/root")
        try:
            os.stat(root)
        except OSError:
            return []
        return [root / inside.lstrip("/") for inside in self.volumes]

    def held_by(self, container: str, pid: int) -> EngineDisk:
        return EngineDisk(self.volumes, self.size, container, pid)

    def holds(self, path: str) -> bool:
        return any(posixpath.commonpath([path, inside]) == inside for inside in self.volumes)


def init_user(commands_uid: int) -> str:
    """The uid the holding container's init and its sleep run as: never the commands' (a process without
    ``CAP_KILL`` signals its own uid's alone, so no command can kill what holds the sandbox)."""
    return INIT_USER_BESIDE_ROOT if commands_uid == 0 else INIT_USER


def mounts(volumes: Mapping[str, str], *, read_only: bool = False, only: set[str] | None = None) -> list[Any]:
    """The ``Mount`` list for a container of the sandbox (``only``: those sandbox paths alone). ``no_copy``:
    the engine would otherwise fill an empty volume from the image's directory at that path (the image's
    own repository, with its later commits, under the workspace)."""
    import docker

    return [
        docker.types.Mount(inside, name, type="volume", read_only=read_only, no_copy=True)
        for inside, name in volumes.items()
        if only is None or inside in only
    ]


def create(client: Any, paths: list[str], size: int, owner: tuple[int, int], labels: Mapping[str, str],
           prefix: str) -> EngineDisk:  # fmt: skip
    """A tmpfs volume of ``size`` bytes per sandbox path in ``paths`` (its root ``owner``'s), held by no
    container yet (:meth:`EngineDisk.held_by` once the command container runs). Nothing is left behind on
    failure."""
    options = f"size={size},uid={owner[0]},gid={owner[1]},mode=0755,nosuid,nodev"
    volumes: dict[str, str] = {}
    try:
        for i, inside in enumerate(paths):
            name = f"{prefix}-{i}"
            client.volumes.create(
                name=name, driver="local", labels=dict(labels),
                driver_opts={"type": "tmpfs", "device": "tmpfs", "o": options},
            )  # fmt: skip
            volumes[inside] = name
        return EngineDisk(volumes, size)
    except BaseException:
        remove(client, [], list(volumes.values()))
        raise


def start(api: Any, cid: str) -> None:
    """Start ``cid``. The engine's transient failures under load (a server error such as runc's "cannot
    start a stopped process") are tried again, ``START_TRIES`` times in all."""
    import docker

    for attempt in range(START_TRIES):
        try:
            api.start(cid)
            return
        except docker.errors.APIError as exc:
            if attempt == START_TRIES - 1 or not exc.is_server_error():
                raise
            time.sleep(0.2 * (attempt + 1))


def put_tree(
    client: Any,
    disk: EngineDisk,
    tree: Path,
    inside: str,
    covered: Iterable[str] = (),
    owner: tuple[int, int] | None = None,
    spool_dir: Path | None = None,
) -> None:
    """Copy the host directory ``tree`` (its modes and links as they are, its owners or every entry
    ``owner``'s) into the volume at ``inside``, but for the paths below it in ``covered`` (where the
    container binds something else over the volume: nothing would ever see them); a tree larger than the
    volume is ``disk_full``."""
    import docker

    hidden = {posixpath.normpath(path) for path in covered}

    def entry(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        if info.name in hidden:
            return None
        if owner is not None:
            info.uid, info.gid, info.uname, info.gname = *owner, "", ""
        return info

    with tempfile.TemporaryFile(dir=spool_dir or tree.parent) as spool:
        with tarfile.open(fileobj=spool, mode="w") as tar:
            for name in sorted(os.listdir(tree)):
                tar.add(tree / name, arcname=name, filter=entry)
        spool.seek(0)
        try:
            client.api.put_archive(disk.keeper, inside, spool)
        except docker.errors.APIError as exc:
            kind = _kind(exc, "image_error")
            raise SandboxError(f"copying the workspace into its volume: {exc}", kind) from exc


def write_file(client: Any, disk: EngineDisk, path: str, data: bytes, owner: tuple[int, int]) -> None:
    """``data`` at the sandbox path ``path`` (in one of the volumes), new parents and the file ``owner``'s."""
    import docker

    root, parts = _locate(disk, path)
    if not parts:
        raise SandboxPathError(f"{path!r} is a volume's root, not a file")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for depth in range(1, len(parts)):
            info = tarfile.TarInfo("/".join(parts[:depth]))
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, *owner
            tar.addfile(info)
        info = tarfile.TarInfo("/".join(parts))
        info.size, info.mode, info.uid, info.gid = len(data), 0o644, *owner
        tar.addfile(info, io.BytesIO(data))
    try:
        client.api.put_archive(disk.keeper, root, buf.getvalue())
    except docker.errors.APIError as exc:
        raise SandboxError(f"writing {path}: {exc}", _kind(exc)) from exc


def read_file(client: Any, disk: EngineDisk, path: str, limit: int | None = None) -> bytes:
    """The regular file at the sandbox path ``path`` (a link is not followed out: the engine resolves it
    inside the holding container, and anything but a regular file is refused); ``limit``: its first
    ``limit`` bytes alone, read off the engine's stream (a file as large as the volume costs no memory)."""
    import docker

    _locate(disk, path)
    try:
        stream, _ = client.api.get_archive(disk.keeper, path)
    except docker.errors.NotFound as exc:
        raise FileNotFoundError(path) from exc
    with tarfile.open(fileobj=_Chunks(stream), mode="r|") as tar:
        member = tar.next()
        if member is None or not member.isfile():
            raise SandboxPathError(f"{path!r} is not a regular file")
        extracted = tar.extractfile(member)
        assert extracted is not None
        return extracted.read() if limit is None else extracted.read(limit)


def tree_digests(
    client: Any, disk: EngineDisk, inside: str, wanted: Callable[[str], bool]
) -> dict[str, tuple[str, int, str]]:
    """Each entry under the volume's path ``inside`` whose path below it ``wanted`` takes: its kind (``file``,
    ``link``, ``other``), size, and the SHA-256 of its bytes (a link's: its target), read from the archive
    the engine streams (nothing lands on the host disk, nothing is followed)."""
    import docker

    _locate(disk, inside)
    try:
        stream, _ = client.api.get_archive(disk.keeper, inside)
    except docker.errors.APIError as exc:
        raise SandboxError(f"reading {inside}: {exc}") from exc
    out: dict[str, tuple[str, int, str]] = {}
    with tarfile.open(fileobj=_Chunks(stream), mode="r|") as tar:
        for member in tar:
            rel = member.name.partition("/")[2]  # below the archive's top directory (``inside``'s name)
            if not rel or not wanted(rel):
                continue
            digest = hashlib.sha256()
            if member.isfile():
                kind, extracted = "file", tar.extractfile(member)
                assert extracted is not None
                while chunk := extracted.read(1 << 20):
                    digest.update(chunk)
            elif member.issym() or member.islnk():
                kind = "link"
                digest.update(member.linkname.encode("utf-8", "surrogateescape"))
            else:
                kind = "other"
            out[rel] = (kind, member.size, digest.hexdigest())
    return out


class _Chunks(io.RawIOBase):
    """The engine's archive stream (an iterator of byte chunks) as a file ``tarfile`` reads in order."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._chunks, self._left = iter(chunks), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._left:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._left = chunk
        n = min(len(buffer), len(self._left))
        buffer[:n], self._left = self._left[:n], self._left[n:]
        return n


def remove(client: Any, containers: list[str], volumes: list[str]) -> None:
    """The containers still using the volumes first, then the volumes."""
    for cid in containers:
        with contextlib.suppress(Exception):
            client.api.remove_container(cid, force=True)
    for name in volumes:
        with contextlib.suppress(Exception):
            client.api.remove_volume(name, force=True)


def _locate(disk: EngineDisk, path: str) -> tuple[str, list[str]]:
    """The volume's sandbox path holding ``path`` and ``path``'s parts below it."""
    norm = posixpath.normpath(path)
    if not posixpath.isabs(norm) or not disk.holds(norm):
        raise SandboxPathError(f"{path!r} is in none of the sandbox's volumes")
    root = next(inside for inside in disk.volumes if posixpath.commonpath([norm, inside]) == inside)
    return root, [p for p in posixpath.relpath(norm, root).split("/") if p not in ("", ".")]


def _kind(exc: Exception, otherwise: FailureKind = "sandbox_error") -> FailureKind:
    return "disk_full" if "no space left" in str(exc).lower() else otherwise
