"""The base image, built here from Debian's mirror (no container registry needed), cached by content key.

``mmdebstrap --variant=minbase`` makes a root filesystem tarball of Debian with what every sandbox uses
(Python with pytest, git, CA certificates); ``docker import`` turns it into an image tagged
``rollbus/debian:<suite>-<key>``, the key a hash of everything that decides its bytes, and also under the
public name (``debian:bookworm``, where nothing holds that name yet), so an unmodified task Dockerfile
``FROM debian:bookworm`` builds on a machine that reaches no registry. Built once per machine (about 90 s),
found by its tag afterwards: a second call builds nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbus.config import cache_dir
from rollbus.local_images.build import alias, ensure_made, has_image
from rollbus.tar_extract import extract_tar

BUILD_TIMEOUT_S = 900.0


class ImageBuildError(RuntimeError):
    """The base image could not be built (mmdebstrap missing or failing, the import refused)."""


@dataclass(frozen=True)
class BaseImage:
    """What decides a base image's bytes; ``key`` hashes it, so a changed recipe is a new tag."""

    suite: str = "bookworm"
    variant: str = "minbase"
    packages: tuple[str, ...] = ("python3", "python3-pytest", "git", "ca-certificates")
    public_name: str | None = "debian:bookworm"
    recipe: int = 1  # bump when the way it is made changes

    @property
    def key(self) -> str:
        fields = [self.suite, self.variant, sorted(self.packages), self.recipe]
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:12]

    @property
    def tag(self) -> str:
        return f"rollbus/debian:{self.suite}-{self.key}"


BASE = BaseImage()


def ensure_base_image(client: Any, base: BaseImage = BASE) -> str:
    """The base image's tag, building it first if this engine lacks it (one builder at a time per machine)."""
    ensure_made(client, base.tag, lambda: _build(client, base))
    if base.public_name:
        alias(client, base.tag, base.public_name)
    return base.tag


def _build(client: Any, base: BaseImage) -> None:
    mmdebstrap = shutil.which("mmdebstrap")
    if mmdebstrap is None:
        raise ImageBuildError("no mmdebstrap here: run scripts/bootstrap.sh --test (it installs it)")
    with tempfile.TemporaryDirectory(prefix="rollbus-base-", dir=cache_dir()) as tmp:
        rootfs = f"{tmp}/rootfs.tar"
        argv = [mmdebstrap, f"--variant={base.variant}", f"--include={','.join(base.packages)}", base.suite,
                rootfs]  # fmt: skip
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            raise ImageBuildError(f"mmdebstrap took over {BUILD_TIMEOUT_S:.0f} s") from exc
        if done.returncode != 0:
            raise ImageBuildError(f"mmdebstrap failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        repository, _, tag = base.tag.partition(":")
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 'CMD ["bash"]']
        client.api.import_image_from_file(rootfs, repository=repository, tag=tag, changes=changes)
    if not has_image(client, base.tag):
        raise ImageBuildError(f"the engine did not keep the imported image {base.tag}")


def export_tree(client: Any, image: str, path: str, dest: Path) -> Path:
    """The directory ``path`` of a container image, as a host directory at ``dest`` (for host-side work on
    a task's tree: the grader's copy to patch, a validation). Nothing of the image runs: the container is
    created, read and removed; the archive is spooled to a temporary file and unpacked with the ``tar``
    filter, as :func:`rollbus.grading.run.materialize` unpacks a tarball image (no member lands outside
    ``dest``; symlinks stay links, as the repository has them)."""
    import docker

    try:
        cid = client.api.create_container(image, ["true"], entrypoint=[], network_disabled=True)["Id"]
    except docker.errors.ImageNotFound as exc:
        raise ImageBuildError(f"no image {image!r} in the Docker engine") from exc
    try:
        stream, _ = client.api.get_archive(cid, path.rstrip("/") + "/.")
        with tempfile.TemporaryFile() as spool:
            for chunk in stream:
                spool.write(chunk)
            spool.seek(0)
            dest.mkdir(parents=True, exist_ok=True)
            with tarfile.open(fileobj=spool) as archive:
                extract_tar(archive, dest)
    finally:
        client.api.remove_container(cid, force=True)
    return dest


def ensure_harbor_image(client: Any, task_dir: Path, harbor: Mapping[str, Any]) -> str | None:
    """A Harbor task's image (``metadata.harbor.build_image``, tagged by the task's content hash), built
    from its ``environment/`` folder where the engine lacks it; None when the task names a ready image
    (``[environment] docker_image``). Its ``FROM`` must be local or one of the local equivalents
    (``debian:bookworm``, ``python:3.11-slim-bookworm``: :mod:`rollbus.local_images`); the base image is
    made first so ``FROM debian:bookworm`` always resolves."""
    from rollbus.local_images.build import ImageError, ensure_image

    tag = harbor.get("build_image")
    if not isinstance(tag, str) or not tag:
        return None
    context = Path(task_dir) / str(harbor.get("environment_dir") or "environment")
    if not (context / "Dockerfile").is_file():
        raise ImageBuildError(f"{context}/Dockerfile: no such file (the Harbor task's environment)")
    ensure_base_image(client)
    try:
        return ensure_image(client, tag, context)
    except ImageError as exc:
        raise ImageBuildError(str(exc)) from exc


TREE_REPOSITORY = "rollbus-tree"


def ensure_tree_image(client: Any, tree: Path, workdir: str) -> str:
    """A container image of a row whose image is a host directory (a repository, as the swe-mini rows name
    theirs): the base image with ``tree`` at ``workdir``, tagged by the tree's content, so the docker backend
    runs path rows as it runs container rows (the agent's image digest is what the grader grades in). Built
    once per content; what the sandbox scrubs of the repository's history it scrubs here too."""
    from rollbus.local_images.build import build, content_key, ensure_made

    if not tree.is_dir():
        raise ImageBuildError(
            f"{tree}: not a directory (the docker backend makes images of directories only)"
        )
    base = ensure_base_image(client)
    name = re.sub(r"[^a-z0-9._-]+", "-", tree.name.lower()).strip("._-") or "tree"
    tag = f"{TREE_REPOSITORY}/{name}:{content_key(base, workdir, tree)}"

    def make() -> None:
        with tempfile.TemporaryDirectory(prefix="rollbus-tree-", dir=cache_dir()) as tmp:
            context = Path(tmp)
            shutil.copytree(tree, context / "tree", symlinks=True)
            (context / "Dockerfile").write_text(f"FROM {base}\nCOPY tree {workdir}\nWORKDIR {workdir}\n")
            build(client, context, tag, {})

    return ensure_made(client, tag, make)
