"""A Kafka image built here: the embedded broker's jars on Debian's JRE, for Compose and testcontainers.

Where a registry serves ``apache/kafka`` nobody needs this. Where none does (this machine, an air-gapped
cluster), :func:`ensure_kafka_image` builds ``rollbus/kafka:<version>-<key>`` from the recipe in
``rollbus/kafka/image/`` on the local Debian base (:mod:`rollbus.sandbox.docker_images`), with the same Maven
Central jars :mod:`rollbus.kafka.runtime` fetched for the embedded broker. The key hashes the recipe, the jar
names and the base's tag, so a second call builds nothing and a version bump builds afresh.

The image honours the variables both public images read (``KAFKA_FOO_BAR`` becomes ``foo.bar``), runs
apache/kafka's entry point by default, and offers cp-kafka's ``/etc/confluent/docker`` steps, which
testcontainers' ``KafkaContainer`` drives.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollbus.config import cache_dir
from rollbus.kafka.runtime import BrokerError, fetch

RECIPE = Path(__file__).resolve().parent / "image"
REPOSITORY = "rollbus/kafka"


def kafka_version(jars: Path) -> str:
    """The Kafka version of the fetched jars (from ``kafka-clients-<version>.jar``)."""
    for jar in jars.glob("kafka-clients-*.jar"):
        return jar.name.removeprefix("kafka-clients-").removesuffix(".jar")
    raise BrokerError(f"no kafka-clients jar in {jars}")


def image_key(jars: Path, base_tag: str) -> str:
    """What decides the image's bytes: every recipe file, every jar's name and size, and the base."""
    digest = hashlib.sha256(base_tag.encode())
    for path in sorted(p for p in RECIPE.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(RECIPE)).encode() + b"\0" + path.read_bytes())
    for jar in sorted(jars.glob("*.jar")):
        digest.update(f"{jar.name}:{jar.stat().st_size}".encode())
    return digest.hexdigest()[:12]


def ensure_kafka_image(client: Any, base_tag: str) -> str:
    """The Kafka image's tag on ``client``'s engine, built first if the engine lacks it (one builder at a
    time per machine). ``base_tag`` names the Debian image it builds on."""
    jars = fetch()
    tag = f"{REPOSITORY}:{kafka_version(jars)}-{image_key(jars, base_tag)}"
    if _has(client, tag):
        return tag
    lock_path = cache_dir() / "docker-images.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _has(client, tag):
            _build(client, jars, base_tag, tag)
    return tag


def _has(client: Any, name: str) -> bool:
    import docker

    try:
        client.images.get(name)
    except docker.errors.ImageNotFound:
        return False
    return True


def _build(client: Any, jars: Path, base_tag: str, tag: str) -> None:
    import docker

    with tempfile.TemporaryDirectory(prefix="rollbus-kafka-image-", dir=cache_dir()) as tmp:
        context = Path(tmp) / "context"
        shutil.copytree(RECIPE, context)
        (context / "jars").mkdir()
        for jar in jars.glob("*.jar"):
            shutil.copy2(jar, context / "jars" / jar.name)
        try:
            client.images.build(
                path=str(context), tag=tag, buildargs={"BASE": base_tag}, network_mode="host", rm=True,
                forcerm=True, pull=False,
            )  # fmt: skip
        except docker.errors.BuildError as exc:
            tail = "".join(str(line.get("stream") or line.get("error") or "") for line in exc.build_log)
            raise BrokerError(f"the Kafka image did not build: {exc.msg}\n{tail[-1500:]}") from exc
