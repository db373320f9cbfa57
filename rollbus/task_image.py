"""What a row says about where its task runs: the image, the workdir and the user the agent runs as.

``metadata.image`` is either a host path (a repository directory or tarball, what the bwrap backend runs over)
or a container image reference (``name[:tag][@sha256:...]``, what a container backend starts). A reference is
told from a path by its shape alone, so a row reads the same on every machine: a path starts with ``/`` or
``.``, or ends in a tarball suffix; a container reference carries a tag or a digest, or is written
``docker://REF``. Anything else (``images/sum-to``) is a path, as rows have always been read.

``metadata.user`` is the OS user the agent runs as (a name, ``uid`` or ``uid:gid``); only a container backend
can honour it (bwrap runs every agent as a per-sandbox unprivileged host uid). Pure functions; a bad value
raises :class:`ImageFieldError` naming the field.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rollbus.sandbox.limits import MIB, Limits

ImageKind = Literal["path", "container"]

CONTAINER_PREFIX = "docker://"
TARBALL_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".tar.zst")
# distribution/reference's grammar, simplified: [domain[:port]/]path[:tag][@algo:hex]
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9-]+)*(?::[0-9]+)?/)"
REFERENCE = re.compile(
    rf"^(?P<name>{_DOMAIN}?{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[0-9a-f]{64}))?$"
)
USER = re.compile(r"^(?:[a-z_][a-z0-9_-]{0,31}|[0-9]{1,10}(?::[0-9]{1,10})?)$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class ImageFieldError(ValueError):
    """A row's image, workdir or user is unusable; the message names the field."""


@dataclass(frozen=True)
class ImageRef:
    """A row's image: ``text`` is the path or the reference (without ``docker://``); ``digest`` the
    ``sha256:...`` a container reference pins, if it pins one."""

    kind: ImageKind
    text: str
    digest: str | None = None


def image_kind(text: str) -> ImageKind:
    """``container`` for ``docker://REF`` and for references with a tag or digest; ``path`` otherwise."""
    if text.startswith(CONTAINER_PREFIX):
        return "container"
    if text.startswith(("/", ".", "~")) or text.endswith(TARBALL_SUFFIXES):
        return "path"
    match = REFERENCE.match(text)
    return "container" if match and (match["tag"] or match["digest"]) else "path"


def parse_image(value: object, field: str = "metadata.image") -> ImageRef:
    """The row's image as an :class:`ImageRef`; a container reference must be well formed."""
    if not isinstance(value, str) or not value.strip():
        raise ImageFieldError(f"{field} must be a non-empty string (a host path or a container image)")
    if value != value.strip() or "\n" in value or "\0" in value:
        raise ImageFieldError(f"{field} has surrounding whitespace or control characters: {value!r}")
    if image_kind(value) == "path":
        return ImageRef("path", value)
    ref = value.removeprefix(CONTAINER_PREFIX)
    match = REFERENCE.match(ref)
    if match is None:
        grammar = "name[:tag][@sha256:...]"
        raise ImageFieldError(f"{field} is not a container image reference ({grammar}): {ref!r}")
    return ImageRef("container", ref, match["digest"])


def parse_workdir(value: object, field: str = "metadata.workdir") -> str:
    """An absolute, normal POSIX path (no ``..``, no control characters)."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise ImageFieldError(f"{field} must be an absolute path inside the sandbox, got {value!r}")
    parts = value.split("/")
    if ".." in parts or any(ord(c) < 32 for c in value):
        raise ImageFieldError(f"{field} must not hold '..' or control characters: {value!r}")
    return value


def parse_user(value: object, field: str = "metadata.user") -> str | None:
    """The agent's OS user: a user name, ``uid`` or ``uid:gid``; None when the row names none."""
    if value in (None, ""):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if not isinstance(value, str) or not USER.match(value):
        raise ImageFieldError(f"{field} must be a user name, uid or uid:gid, got {value!r}")
    return value


def parse_digest(value: object, field: str = "image_digest") -> str | None:
    """A ``sha256:<64 hex>`` image digest, or None."""
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not DIGEST.match(value):
        raise ImageFieldError(f"{field} must be sha256:<64 hex digits>, got {value!r}")
    return value


def pinned(ref: ImageRef, digest: str | None) -> str:
    """The reference that names exactly ``digest``'s bytes (``name@sha256:...``): what a regrade starts."""
    if ref.kind != "container" or digest is None:
        return ref.text
    name = REFERENCE.match(ref.text)
    assert name is not None
    return f"{name['name']}@{digest}"


def row_limits(base: Limits, metadata: Mapping[str, Any]) -> Limits:
    """The operator's limits narrowed by what the row asks (``agent_timeout_sec``, ``resources.cpus``,
    ``memory_mb``, ``storage_mb``): a task gets what it asks, never more than the operator allows."""

    def narrowed(current: float | None, asked: Any, scale: float) -> Any:
        if isinstance(asked, bool) or not isinstance(asked, int | float) or asked <= 0:
            return current
        value = asked * scale
        return value if current is None else min(current, value)

    resources = asked if isinstance(asked := metadata.get("resources"), Mapping) else {}
    memory = narrowed(base.memory_bytes, resources.get("memory_mb"), MIB)
    disk = narrowed(base.disk_bytes, resources.get("storage_mb"), MIB)
    return dataclasses.replace(
        base,
        cpus=narrowed(base.cpus, resources.get("cpus"), 1),
        memory_bytes=None if memory is None else int(memory),
        disk_bytes=None if disk is None else int(disk),
        wall_s=narrowed(base.wall_s, metadata.get("agent_timeout_sec"), 1),
    )
