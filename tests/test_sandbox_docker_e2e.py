"""The runner with ``--backend docker`` end to end: the real Claude Code CLI (from the cache, mounted
read-only: the image has no CLI of its own) in a container of the task's image, against the real adapter and
the scripted engine; its patch taken inside the container and returned as the `diffs` record carries it.
"""

from __future__ import annotations

import asyncio
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollbus.rows import RowKeys, parse_row, tasks_for
from rollbus.sandbox import docker_engine, docker_images
from rollbus.services.sandbox_runner.main import run_one
from rollbus.services.sandbox_runner.settings import RunnerSettings
from tests.e2e_support import EXAMPLES, SCRIPTS, Rig
from tests.runner_support import FIXED_LINE, RUNNER_SCRIPTS, calc_row, scripts_dir
from tests.test_sandbox_runner_e2e import new_namespace

pytestmark = [pytest.mark.kafka, pytest.mark.docker]

CALC_IMAGE = "rollbus-test/calc:1"
# The repository at /workspace with its base commit; the image has Python, git and nothing of rollbus's.
DOCKERFILE = """FROM {base}
COPY repo /workspace
RUN cd /workspace && git init -q && git add -A && git -c user.name=a -c user.email=a@b commit -qm base
"""


@pytest.fixture(scope="module")
def calc_image() -> str:
    client = docker_engine.client()
    base = docker_images.ensure_base_image(client)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        dockerfile = DOCKERFILE.format(base=base).encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
        tar.add(EXAMPLES / "buggy_repo", arcname="repo")
    context.seek(0)
    client.images.build(fileobj=context, custom_context=True, tag=CALC_IMAGE, rm=True, network_mode="none")
    return CALC_IMAGE


@pytest.fixture(scope="module")
def rig(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("docker-runner")
    rig = Rig(kafka_bootstrap, asyncio.run(new_namespace(kafka_bootstrap)), work)
    rig.start()
    scripts = {"calc-fix": SCRIPTS / "fix_calc.json", "calc-noedit": RUNNER_SCRIPTS / "never_edits.json"}
    rig.use_script(scripts_dir(work / "scripts", scripts))
    try:
        yield rig
    finally:
        rig.stop()


def task_in(image: str, instance: str, data_dir: Path) -> dict[str, Any]:
    row = parse_row(json.dumps(calc_row(instance)), 1, RowKeys(), data_dir)
    (task,) = tasks_for(row, 1)
    metadata = json.loads(task["metadata"])
    task["metadata"] = json.dumps({**metadata, "image": image})  # a container image, by name
    return task


async def test_the_real_cli_fixes_the_task_in_a_container_of_its_image(
    rig: Rig, calc_image: str, tmp_path: Path
) -> None:
    options = {"adapter_url": rig.url, "admin_token": rig.admin_token, "backend": "docker"}
    settings = RunnerSettings.load({**options, "sandbox_root": tmp_path})
    fixed = await run_one(settings, task_in(calc_image, "calc-fix", tmp_path))
    assert fixed["failure_kind"] is None, fixed["error"]
    assert FIXED_LINE.encode() in fixed["patch"] and b"test_calc.py" not in fixed["patch"]
    idle = await run_one(settings, task_in(calc_image, "calc-noedit", tmp_path))
    assert idle["failure_kind"] is None and idle["patch"] == b"", idle["error"]
    assert not list(tmp_path.glob("*.docker"))  # every sandbox's host side is gone
