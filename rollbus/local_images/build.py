"""Building one image from a recipe folder: a content key, one builder per machine, errors in one message."""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rollbus.config import cache_dir


class ImageError(RuntimeError):
    """An image could not be built; the message says which and why (the build log's tail)."""


def content_key(*parts: bytes | str | Path) -> str:
    """A short hash of ``parts``: bytes and strings as they are, a file by its name and bytes, a folder by
    every file in it (relative names and bytes, in order)."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, Path):
            files = sorted(p for p in part.rglob("*") if p.is_file()) if part.is_dir() else [part]
            for path in files:
                name = path.relative_to(part) if part.is_dir() else Path(path.name)
                digest.update(str(name).encode() + b"\0" + path.read_bytes() + b"\0")
        else:
            digest.update((part.encode() if isinstance(part, str) else part) + b"\0")
    return digest.hexdigest()[:12]


def has_image(client: Any, name: str) -> bool:
    return image_id(client, name) is not None


def ensure_image(
    client: Any,
    tag: str,
    recipe: Path,
    *,
    buildargs: dict[str, str] | None = None,
    add: Callable[[Path], None] | None = None,
    dockerfile: str = "Dockerfile",
) -> str:
    """``tag`` on ``client``'s engine, built from ``recipe`` first if missing (one builder at a time per
    machine). ``add(context)`` puts more files into the build context (a copy of the recipe) first."""

    def make() -> None:
        with tempfile.TemporaryDirectory(prefix="rollbus-image-", dir=cache_dir()) as tmp:
            context = Path(tmp) / "context"
            shutil.copytree(recipe, context)
            if add is not None:
                add(context)
            build(client, context, tag, buildargs or {}, dockerfile)

    return ensure_made(client, tag, make)


def ensure_made(client: Any, tag: str, make: Callable[[], None]) -> str:
    """``tag`` on ``client``'s engine, ``make()`` run first if the engine lacks it: one maker at a time per
    machine (a lock file), and the tag looked for again under the lock, so a second caller builds nothing."""
    if has_image(client, tag):
        return tag
    lock_path = cache_dir() / "docker-images.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not has_image(client, tag):
            make()
    return tag


def alias(client: Any, tag: str, public_name: str) -> None:
    """Tag ``tag`` also as ``public_name`` where nothing holds that name yet (a registry's image is kept)."""
    if not has_image(client, public_name):
        repository, _, name_tag = public_name.partition(":")
        client.images.get(tag).tag(repository, name_tag or "latest")


def build(
    client: Any, context: Path, tag: str, buildargs: dict[str, str], dockerfile: str = "Dockerfile"
) -> None:
    """``docker build`` with the host's network (registries are reached from the build, never from a
    sandbox), never pulling: every base is local or was built here. The image ``tag`` named before is removed
    once the tag moves, unless something still holds it (see :func:`drop_replaced`)."""
    import docker

    before = image_id(client, tag)
    try:
        built, _ = client.images.build(
            path=str(context), dockerfile=dockerfile, tag=tag, buildargs=buildargs, network_mode="host",
            rm=True, forcerm=True, pull=False,
        )  # fmt: skip
    except docker.errors.BuildError as exc:
        raise ImageError(f"{tag} did not build: {exc.msg}\n{log_tail(exc.build_log)}") from exc
    except docker.errors.APIError as exc:
        raise ImageError(f"{tag} did not build: {exc.explanation or exc}") from exc
    if before is not None and before != built.id:
        drop_replaced(client, before)


def image_id(client: Any, name: str) -> str | None:
    import docker

    try:
        return str(client.images.get(name).id)
    except docker.errors.ImageNotFound:
        return None


def drop_replaced(client: Any, old_id: str) -> None:
    """Remove the image a rebuilt tag named before: left untagged, each rebuild of the rollbus image (8 GB)
    kept its predecessor, and a machine that ran a few changed trees had its disk full. An image another tag
    or a container still holds is kept (the engine refuses; nothing is forced)."""
    import docker

    try:
        client.images.remove(old_id, noprune=False)
    except docker.errors.APIError:
        pass


def log_tail(lines: Iterable[dict[str, Any]], chars: int = 1500) -> str:
    text = "".join(str(line.get("stream") or line.get("error") or "") for line in lines)
    return text[-chars:]


def host_ca_certificates() -> list[Path]:
    """The CA certificates this host added to Debian's store (``/usr/local/share/ca-certificates``): a
    TLS-inspecting proxy in front of the registries is trusted there, so images built here trust it too."""
    folder = Path("/usr/local/share/ca-certificates")
    return sorted(p for p in folder.rglob("*.crt") if p.is_file()) if folder.is_dir() else []
