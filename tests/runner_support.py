"""Pieces the sandbox runner's end-to-end tests share: a dataset of rows over example repositories, the
per-task scripts directory the engine replays, runner processes, and waiting for `diffs` on the bus."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil
from aiokafka import TopicPartition

from rollbus.grading import GradeConfig
from rollbus.kafka import clients
from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import describe, topic_name
from rollbus.rows import RowKeys, parse_row, tasks_for
from rollbus.services.grader.core import grade_diff
from rollbus.services.sandbox_runner.main import run_one
from rollbus.services.sandbox_runner.settings import RunnerSettings
from tests.e2e_support import EXAMPLES, Rig

RUNNER_SCRIPTS = EXAMPLES / "scripts" / "runner"
FIXED_LINE = "+    return sum(range(1, n + 1))"
CALC_PROBLEM = "The tests in /workspace fail. Fix the bug."


def calc_row(instance_id: str, *, image: str = "buggy_repo", label: str | None = None) -> dict[str, Any]:
    """A row over ``examples/buggy_repo`` (the image relative to the dataset file, as users write it)."""
    metadata = {"image": image, "workdir": "/workspace", "instance_id": instance_id,
                "problem_statement": CALC_PROBLEM, "eval_cmd": "python3 -m unittest -q"}  # fmt: skip
    return {"prompt": "", "label": label, "metadata": metadata}


async def run_and_grade(
    rig: Rig, data_dir: Path, instance: str, *, row_agent: str | None = None, **settings: object
) -> tuple[dict, float]:
    """One calc row (its ``metadata.agent`` is ``row_agent`` where one is named) run by the runner
    (``run_one``), then graded as the grader service grades its diff: the diff and its reward."""
    row = calc_row(instance)
    if row_agent is not None:
        row["metadata"]["agent"] = row_agent
    (task,) = tasks_for(parse_row(json.dumps(row), 1, RowKeys(), data_dir), 1)
    runner = RunnerSettings.load({"adapter_url": rig.url, "admin_token": rig.admin_token, **settings})
    diff = await run_one(runner, task)
    graded = await grade_diff(diff, data_dir, GradeConfig())
    return diff, graded.reward


def write_dataset(path: Path, rows: Iterable[dict[str, Any] | str]) -> Path:
    """JSONL rows (a str is written as the raw line, for malformed rows)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def scripts_dir(dest: Path, scripts: Mapping[str, Path]) -> Path:
    """A ``--script DIR`` for the engine: instance id -> the script its rollouts replay."""
    dest.mkdir(parents=True, exist_ok=True)
    for instance_id, script in scripts.items():
        shutil.copyfile(script, dest / f"{instance_id}.json")
    return dest


def submit(bootstrap: str, namespace: str, dataset: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbus", "submit", str(dataset), "--bootstrap-servers", bootstrap,
         "--namespace", namespace, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


class RunnerProcess:
    """``rollbus sandbox-runner`` as a child process in a session of its own (so kill -9 is real)."""

    def __init__(self, rig: Rig, namespace: str, work: Path, *args: str, name: str = "runner") -> None:
        self.work = work
        self.log_path = work / f"{name}.log"
        self.argv = [
            sys.executable, "-m", "rollbus", "sandbox-runner", "--bootstrap-servers", rig.bootstrap,
            "--namespace", namespace, "--adapter-url", rig.url, "--admin-token", rig.admin_token,
            "--session-timeout-ms", "6000", *args,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def grader(cls, bootstrap: str, namespace: str, work: Path) -> RunnerProcess:
        """``rollbus grader`` on the same topics, started and stopped the same way."""
        grader = cls.__new__(cls)
        grader.work, grader.log_path, grader.proc = work, work / "grader.log", None
        grader.argv = [sys.executable, "-m", "rollbus", "grader", "--bootstrap-servers", bootstrap,
                       "--namespace", namespace]  # fmt: skip
        return grader

    def start(self) -> RunnerProcess:
        self.work.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, env=os.environ.copy())  # fmt: skip
        return self

    def kill9(self) -> list[psutil.Process]:
        """SIGKILL the runner process alone (not its group), as the OOM killer would; returns the processes
        it had started (its sandboxes), which must die with it."""
        assert self.proc is not None
        children = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.kill()
        self.proc.wait(30)
        return children

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


async def wait_for(
    bootstrap: str, namespace: str, topic: str, rollout_ids: set[str], timeout: float, *, count: int = 1
) -> dict[str, list[dict[str, Any]]]:
    """Events of ``rollout_ids`` on ``topic`` until each has ``count`` of them (TimeoutError otherwise)."""
    found: dict[str, list[dict[str, Any]]] = {r: [] for r in rollout_ids}

    async def follow() -> None:
        async for _, decoded in read(bootstrap, ReadPlan(topic_name(topic, namespace), follow=True)):
            if isinstance(decoded, Exception):
                raise decoded
            rollout = decoded.record.get("rollout_id")
            if rollout in found:
                found[rollout].append(decoded.record)
            if all(len(v) >= count for v in found.values()):
                return

    await asyncio.wait_for(follow(), timeout)
    return found


async def all_events(bootstrap: str, namespace: str, topic: str) -> list[dict[str, Any]]:
    records = []
    async for _, decoded in read(bootstrap, ReadPlan(topic_name(topic, namespace))):
        assert not isinstance(decoded, Exception), decoded
        records.append(decoded.record)
    return records


async def group_lag(bootstrap: str, namespace: str, consumer_group: str) -> int:
    """Tasks the group has not committed past (0: every task's offset is committed)."""
    topic = topic_name("tasks", namespace)
    counts = await describe(bootstrap, [topic])
    partitions = [TopicPartition(topic, p) for p in range(counts.get(topic, 0))]
    async with clients.started_consumer(
        bootstrap, client_id="test-lag", consumer_group=consumer_group
    ) as consumer:
        ends = await consumer.end_offsets(partitions)
        lag = 0
        for tp in partitions:
            committed = await consumer.committed(tp)
            lag += ends[tp] - (committed or 0)
        return lag


async def committed_all(bootstrap: str, namespace: str, consumer_group: str) -> bool:
    """Whether the group has committed past every task: the later event that proves a runner is done with
    them, since it commits a task only after the task's diff is out."""
    return await group_lag(bootstrap, namespace, consumer_group) == 0


CALC_IMAGE = "rollbus-test/calc:1"
CALC_DOCKERFILE = """FROM {base}
COPY repo /workspace
RUN cd /workspace && git init -q && git add -A && git -c user.name=a -c user.email=a@b commit -qm base
"""


def build_calc_image() -> str:
    """``examples/buggy_repo`` at /workspace of an image built from the base image (Python, git, no CLI)."""
    import io
    import tarfile

    from rollbus.sandbox import docker_engine, docker_images

    client = docker_engine.client()
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        dockerfile = CALC_DOCKERFILE.format(base=docker_images.ensure_base_image(client)).encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
        tar.add(EXAMPLES / "buggy_repo", arcname="repo")
    context.seek(0)
    client.images.build(fileobj=context, custom_context=True, tag=CALC_IMAGE, rm=True, network_mode="none")
    return CALC_IMAGE


def container_task(image: str, instance: str, data_dir: Path) -> dict:
    (task,) = tasks_for(parse_row(json.dumps(calc_row(instance)), 1, RowKeys(), data_dir), 1)
    task["metadata"] = json.dumps({**json.loads(task["metadata"]), "image": image})  # a container image
    return task
