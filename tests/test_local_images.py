"""Images built here without a registry: the Kafka image (variables to properties; compose's kafka service on
it) and python:3.11-slim-bookworm's equivalent.

The testcontainers path (``KafkaContainer`` on this image) is exercised by ``make test``'s second run, which
forces ``ROLLBUS_TEST_BROKER=docker`` for a share of the broker tests.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollbus.kafka.image import RECIPE, ensure_kafka_image, image_key

ROOT = Path(__file__).resolve().parent.parent
PROPERTIES = RECIPE / "bin" / "kafka-env-properties"


def properties(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAFKA_")}
    return subprocess.run(
        [sys.executable, str(PROPERTIES)], env={**clean, **env}, capture_output=True, text=True, check=False
    )


def test_kafka_variables_become_properties_as_the_public_images_read_them() -> None:
    done = properties({
        "KAFKA_NODE_ID": "1", "KAFKA_BROKER_ID": "1", "KAFKA_LISTENERS": "PLAINTEXT://:9092",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1", "KAFKA_CONFLUENT__SUPPORT": "x",
        "KAFKA_LISTENER___NAME": "y", "KAFKA_HEAP_OPTS": "-Xmx1g", "KAFKA_OPTS": "-Dx=1", "KAFKA_EMPTY": "",
    })  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert got == {
        "log.dirs": "/var/lib/kafka/data", "node.id": "1", "listeners": "PLAINTEXT://:9092",
        "offsets.topic.replication.factor": "1", "confluent_support": "x", "listener-name": "y",
    }  # fmt: skip


def test_disagreeing_broker_and_node_ids_are_refused_by_name() -> None:
    done = properties({"KAFKA_NODE_ID": "1", "KAFKA_BROKER_ID": "2"})
    assert done.returncode == 1 and "KAFKA_BROKER_ID 2 and KAFKA_NODE_ID 1 disagree" in done.stderr


def test_the_image_key_changes_with_the_recipe_the_jars_and_the_base(tmp_path: Path) -> None:
    jars = tmp_path / "jars"
    jars.mkdir()
    (jars / "kafka-clients-4.1.1.jar").write_bytes(b"x" * 10)
    first = image_key(jars, "base:1")
    assert image_key(jars, "base:1") == first
    assert image_key(jars, "base:2") != first
    (jars / "extra-1.0.jar").write_bytes(b"y")
    assert image_key(jars, "base:1") != first


def compose_kafka() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())["services"]["kafka"]


@pytest.mark.docker
def test_composes_kafka_service_starts_on_the_image_built_here_and_passes_its_health_check() -> None:
    """The compose file's kafka variables and health check, unchanged, on the local image: the broker formats
    its storage, starts, and the health check (an ApiVersions round trip) exits 0 inside the container."""
    import docker

    from rollbus.sandbox.docker_engine import client
    from rollbus.sandbox.docker_images import ensure_base_image

    engine = client()
    image = ensure_kafka_image(engine, ensure_base_image(engine))
    service = compose_kafka()
    health = service["healthcheck"]["test"]
    assert health[0] == "CMD-SHELL"
    network = engine.networks.create(f"rollbus-kafka-test-{os.getpid()}")
    container = None
    try:
        container = engine.containers.run(
            image, detach=True, environment=service["environment"], hostname="kafka",
            network=network.name, mem_limit="768m",
        )  # fmt: skip
        network.reload()
        deadline, code, output = time.monotonic() + 120, None, b""
        while time.monotonic() < deadline:
            container.reload()
            assert container.status in ("created", "running"), container.logs()[-2000:].decode()
            code, output = container.exec_run(["sh", "-c", health[1]])
            if code == 0:
                break
            time.sleep(0.5)
        assert code == 0, (output.decode(), container.logs()[-3000:].decode())
        assert b"Kafka Server started" in container.logs()
    finally:
        if container is not None:
            container.remove(force=True)
        try:
            network.remove()
        except docker.errors.APIError:
            pass


@pytest.mark.docker
def test_the_python_base_stands_in_for_the_public_image_and_trusts_the_hosts_extra_cas() -> None:
    """Built from Debian's mirror under the public name, so ``FROM python:3.11-slim-bookworm`` builds here;
    pip installs without PEP 668's refusal, and every CA the host added is trusted inside."""
    from rollbus.local_images.build import host_ca_certificates
    from rollbus.local_images.python_base import PUBLIC_NAME, ensure_python_base
    from rollbus.sandbox.docker_engine import client
    from rollbus.sandbox.docker_images import ensure_base_image

    engine = client()
    tag = ensure_python_base(engine, ensure_base_image(engine))
    assert engine.images.get(PUBLIC_NAME).id == engine.images.get(tag).id
    script = (
        "import subprocess, sys; print(sys.version_info[:2]); "
        "print(subprocess.run([sys.executable, '-m', 'pip', 'install', '--dry-run', '--no-index', 'x'], "
        "capture_output=True, text=True).stderr.count('externally-managed'))"
    )
    out = engine.containers.run(tag, ["python", "-c", script], network_mode="none", remove=True).decode()
    version, refusals = out.strip().split("\n")
    assert version == "(3, 11)" and refusals == "0"
    listed = engine.containers.run(
        tag, ["ls", "/usr/local/share/ca-certificates/"], network_mode="none", remove=True
    ).decode()
    for cert in host_ca_certificates():
        assert any(line.endswith(cert.name) for line in listed.split()), (cert.name, listed)


@pytest.mark.docker
def test_a_rebuilt_tag_drops_the_image_it_named_unless_a_container_holds_it(tmp_path: Path) -> None:
    """Each changed tree rebuilt ``rollbus:latest`` and left the 8 GB image before it untagged: a machine's
    disk filled after a few. A tag that moves now takes its old image with it; one a container was made from
    is kept (the engine refuses, nothing is forced), and the build still succeeds."""
    import docker

    from rollbus.local_images.build import build
    from rollbus.sandbox.docker_engine import client

    engine = client()
    tag = f"rollbus-test/replaced:{tmp_path.name[-12:].lower().replace('_', '-')}"

    def made(content: str) -> str:
        context = tmp_path / content
        context.mkdir()
        (context / "f").write_text(content)
        (context / "Dockerfile").write_text("FROM scratch\nCOPY f /f\n")
        build(engine, context, tag, {})
        return str(engine.images.get(tag).id)

    def exists(image: str) -> bool:
        try:
            engine.images.get(image)
        except docker.errors.ImageNotFound:
            return False
        return True

    first = made("one")
    second = made("two")
    assert second != first and not exists(first)
    holder = engine.containers.create(second, ["/f"])
    try:
        third = made("three")
        assert third != second and exists(second) and exists(third)
    finally:
        holder.remove(force=True)
        for image in (second, tag):
            with contextlib.suppress(docker.errors.APIError):
                engine.images.remove(image, force=True)
