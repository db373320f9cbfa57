"""``python:3.11-slim-bookworm``'s equivalent, built from Debian's mirror where no registry serves it.

Tagged ``rollbus/python:3.11-slim-bookworm-<key>`` and, where nothing holds the public name yet, also under
it, so the compose Dockerfile and task Dockerfiles ``FROM python:3.11-slim-bookworm`` build unmodified.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rollbus.local_images.build import alias, content_key, ensure_image, host_ca_certificates

RECIPE = Path(__file__).resolve().parent / "python"
PUBLIC_NAME = "python:3.11-slim-bookworm"


def ensure_python_base(client: Any, base_tag: str) -> str:
    """The equivalent's tag on ``client``'s engine (built on ``base_tag`` if missing)."""
    certificates = host_ca_certificates()
    key = content_key(base_tag, RECIPE, *certificates)
    tag = f"rollbus/python:3.11-slim-bookworm-{key}"

    def add(context: Path) -> None:
        (context / "ca").mkdir(exist_ok=True)
        for i, cert in enumerate(certificates):
            shutil.copy(cert, context / "ca" / f"host-{i}-{cert.name}")

    ensure_image(client, tag, RECIPE, buildargs={"BASE": base_tag}, add=add)
    alias(client, tag, PUBLIC_NAME)
    return tag
