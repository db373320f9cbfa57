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

import shutil
from pathlib import Path
from typing import Any

from rollbus.kafka.runtime import BrokerError, fetch
from rollbus.local_images.build import content_key, ensure_image

RECIPE = Path(__file__).resolve().parent / "image"
REPOSITORY = "rollbus/kafka"


def kafka_version(jars: Path) -> str:
    """The Kafka version of the fetched jars (from ``kafka-clients-<version>.jar``)."""
    for jar in jars.glob("kafka-clients-*.jar"):
        return jar.name.removeprefix("kafka-clients-").removesuffix(".jar")
    raise BrokerError(f"no kafka-clients jar in {jars}")


def image_key(jars: Path, base_tag: str) -> str:
    """What decides the image's bytes: the recipe, every jar's name and size, and the base."""
    sizes = "".join(f"{jar.name}:{jar.stat().st_size}\n" for jar in sorted(jars.glob("*.jar")))
    return content_key(base_tag, RECIPE, sizes)


def ensure_kafka_image(client: Any, base_tag: str) -> str:
    """The Kafka image's tag on ``client``'s engine, built on ``base_tag`` first if the engine lacks it."""
    jars = fetch()
    tag = f"{REPOSITORY}:{kafka_version(jars)}-{image_key(jars, base_tag)}"

    def add(context: Path) -> None:
        (context / "jars").mkdir()
        for jar in jars.glob("*.jar"):
            shutil.copy2(jar, context / "jars" / jar.name)

    return ensure_image(client, tag, RECIPE, buildargs={"BASE": base_tag}, add=add)
