"""``rollbus images build``: every image the compose stack and the container tests use, built here.

Where a registry serves the public images nobody needs this; where none does (this machine, an air-gapped
cluster) it builds, from Debian's mirror, PyPI, npm and Maven Central: the Debian base (``mmdebstrap``), the
``python:3.11-slim-bookworm`` equivalent under that name, the Kafka image (the embedded broker's jars) and the
rollbus image of ``compose/Dockerfile`` (``rollbus:latest``). Each is found by its content key next time, and
the rollbus image rebuilds only the layers Docker's cache says changed. Prints the variables for
``compose/.env``: ``KAFKA_IMAGE``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
ROLLBUS_IMAGE = "rollbus:latest"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["build"], help="build: every image, cached by content key")
    parser.add_argument(
        "--no-rollbus", action="store_true", help="only the bases and Kafka, not the rollbus image itself"
    )


def build_all(client: Any, *, rollbus_image: bool = True) -> dict[str, str]:
    """The images' tags by role (``base``, ``python``, ``kafka``, ``rollbus``), each built if missing."""
    from rollbus.kafka.image import ensure_kafka_image
    from rollbus.local_images.build import ImageError, build
    from rollbus.local_images.python_base import ensure_python_base
    from rollbus.sandbox.docker_images import ensure_base_image

    base = ensure_base_image(client)
    tags = {"base": base, "python": ensure_python_base(client, base)}
    tags["kafka"] = ensure_kafka_image(client, base)
    if rollbus_image:
        dockerfile = ROOT / "compose" / "Dockerfile"
        if not dockerfile.exists():
            raise ImageError(f"no {dockerfile}: the rollbus image builds from a clone of the repository")
        build(client, ROOT, ROLLBUS_IMAGE, {"PYTHON_BASE": tags["python"]}, "compose/Dockerfile")
        tags["rollbus"] = ROLLBUS_IMAGE
    return tags


def run(parsed: argparse.Namespace) -> int:
    from rollbus.kafka.runtime import BrokerError
    from rollbus.local_images.build import ImageError
    from rollbus.sandbox.docker_engine import EngineUnavailable, client

    try:
        tags = build_all(client(), rollbus_image=not parsed.no_rollbus)
    except (EngineUnavailable, ImageError, BrokerError) as exc:
        print(f"rollbus images: error: {exc}", file=sys.stderr)
        return 1
    for role, tag in tags.items():
        print(f"# {role}: {tag}", file=sys.stderr)
    print(f"KAFKA_IMAGE={tags['kafka']}")
    return 0
