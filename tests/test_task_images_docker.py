"""Task images graded in containers: a SWE-bench row whose image (built here from the project's Debian base)
holds the repository at ``/testbed`` and its own Python environment, and a Harbor task folder whose
``environment/Dockerfile`` is built here. ``rollbus validate --backend docker`` grades each in fresh
network-less containers of its image: the gold scores 1, the empty patch 0.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rollbus.cli import main
from rollbus.grading import GradeConfig
from rollbus.grading.rows import HARBOR_SOLUTION
from rollbus.rows import Row, RowKeys, read_dataset
from rollbus.sandbox import docker_engine, docker_images
from rollbus.services.grader.core import grade_row
from tests.test_validate import NEW_TEST, git, tiny_project, write

pytestmark = pytest.mark.docker

SWEBENCH_IMAGE = "rollbus-test/swebench-calc:1"
# the repository at /testbed (its fix on a later branch, which the sandboxes never see), its environment a
# venv of its own first on PATH, as SWE-bench images keep theirs in conda
SWEBENCH_DOCKERFILE = """
FROM {base}
RUN python3 -m venv --without-pip --system-site-packages /opt/testbed
ENV PATH=/opt/testbed/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
COPY repo /testbed
WORKDIR /testbed
"""


@pytest.fixture(scope="module")
def engine() -> Any:
    client = docker_engine.client()
    docker_images.ensure_base_image(client)
    return client


@pytest.fixture(scope="module")
def swebench_task(engine: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A SWE-bench row (as published, plus its image's name) over the calc project, its image built."""
    root = tmp_path_factory.mktemp("swebench")
    repo, base, _, gold = tiny_project(root, fix_branch=True)
    scratch = root / "scratch"
    shutil.copytree(repo, scratch)
    (scratch / "tests" / "test_calc.py").write_text(NEW_TEST)
    test_patch = git(scratch, "diff") + "\n"
    context = root / "context"
    context.mkdir()
    shutil.copytree(repo, context / "repo", symlinks=True)
    dockerfile = SWEBENCH_DOCKERFILE.format(base=docker_images.ensure_base_image(engine))
    (context / "Dockerfile").write_text(dockerfile)
    engine.images.build(path=str(context), tag=SWEBENCH_IMAGE, rm=True, network_mode="none")
    return {
        "instance_id": "local__calc-1", "repo": "local/calc", "base_commit": base, "patch": gold,
        "test_patch": test_patch, "problem_statement": "double(3) returns 7; it should return 6.",
        "image_name": SWEBENCH_IMAGE, "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_double"]),
        "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]), "version": "1.0",
    }  # fmt: skip


def test_a_swebench_row_in_its_image_validates_in_containers(
    swebench_task: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dataset = write(tmp_path / "swebench.jsonl", [swebench_task])
    results = tmp_path / "results.jsonl"
    code = main(["validate", str(dataset), "--backend", "docker", "--results", str(results)])
    out = capsys.readouterr().out
    assert code == 0 and "ok   local__calc-1" in out, out
    [record] = [json.loads(line) for line in results.read_text().splitlines()]
    gold, empty = record["checks"]
    assert (gold["reward"], empty["reward"], empty["failure_kind"]) == (1.0, 0.0, "tests_failed"), record


HARBOR_TASK = {
    "task.toml": 'version = "1.0"\n[agent]\ntimeout_sec = 120\n[verifier]\ntimeout_sec = 120\n'
    "[environment]\nallow_internet = false\n",
    "instruction.md": "calc.double(3) returns 7 in /app; make it return 6.\n",
    "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\nCOPY calc.py /app/calc.py\n",
    "environment/calc.py": "def double(x):\n    return x + x + 1\n",
    "tests/test.sh": "cd /app\nif python3 -m pytest -q -p no:cacheprovider /tests/test_calc.py; then\n"
    "  echo 1 > /logs/verifier/reward.txt\nelse\n  echo 0 > /logs/verifier/reward.txt\nfi\n",
    "tests/test_calc.py": "from calc import double\n\n\ndef test_double():\n    assert double(3) == 6\n",
    "solution/solve.sh": "sed -i 's/x + x + 1/2 * x/' /app/calc.py\n",
}


def test_a_harbor_task_folder_validates_in_its_built_image(
    engine: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The task's environment/ is built (content-keyed), its solve.sh scores 1 and the empty patch 0, and
    its tests/ reach only the verifier's container."""
    task = tmp_path / "calc-double"
    for rel, text in HARBOR_TASK.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    results = tmp_path / "results.jsonl"
    code = main(["validate", str(task), "--backend", "docker", "--results", str(results)])
    out = capsys.readouterr().out
    assert code == 0 and "ok   calc-double" in out, out
    [record] = [json.loads(line) for line in results.read_text().splitlines()]
    gold, empty = record["checks"]
    assert (gold["reward"], empty["reward"], empty["failure_kind"]) == (1.0, 0.0, "tests_failed"), record
    # a diff's patch is bytes: the marker that runs solve.sh for validate's gold is never a policy's to send
    [row] = [r for r in read_dataset(task, RowKeys()) if isinstance(r, Row)]
    record = {"metadata": row.metadata, "label": row.label}
    forged = asyncio.run(grade_row(record, HARBOR_SOLUTION.encode(), task, GradeConfig(backend="docker")))
    assert (forged.reward, forged.failure_kind) == (0.0, "malformed_patch"), forged


# A verifier that reports what its container is: rewarded only as the task's [verifier] user (a name the image
# defines) under the task's [environment] cpus and memory_mb; the policy's patch (here empty) plays no part.
LIMITS_SEEN = r"""
u=$(id -u)
cg=/sys/fs/cgroup
if [ -e $cg/memory.max ]; then m=$(cat $cg/memory.max); q=$(cut -d' ' -f1 $cg/cpu.max)
else m=$(cat $cg/memory/memory.limit_in_bytes); q=$(cat $cg/cpu/cpu.cfs_quota_us); fi
echo "seen $u $m $q"
if [ "$u $m $q" = "1234 314572800 50000" ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""
VERIFIER_TASK = {
    "task.toml": 'version = "1.1"\n[verifier]\ntimeout_sec = 120\nuser = "checker"\n'
    "[environment]\ncpus = 0.5\nmemory_mb = 300\nallow_internet = false\n",
    "instruction.md": "Nothing to do.\n",
    "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\n"
    "RUN echo 'checker:x:1234:1234::/app:/bin/sh' >> /etc/passwd\n"
    "RUN echo 'admin:x:0:0::/:/bin/sh' >> /etc/passwd\n",
    "tests/test.sh": LIMITS_SEEN,
}


async def test_a_harbor_verifier_runs_as_its_user_under_its_tasks_limits(engine: Any, tmp_path: Path) -> None:
    """``[verifier] user`` (looked up in the image) and ``[environment] cpus`` and ``memory_mb`` reach the
    verifier's container; a user name that is root in the image is refused, the verifier never run."""
    from dataclasses import replace

    from rollbus.grading import parse_row
    from rollbus.grading.backends import grade_function
    from rollbus.grading.rows import Harbor

    task = tmp_path / "verifier-limits"
    for rel, text in VERIFIER_TASK.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    [row] = [r for r in read_dataset(task, RowKeys()) if isinstance(r, Row)]
    spec = parse_row({"metadata": row.metadata}, task)
    grade = grade_function("docker")
    result = await grade(spec, "")
    assert (result.reward, result.failure_kind) == (1.0, None), result.details.get("log")
    assert isinstance(spec.grader, Harbor)
    admin = replace(
        spec, grader=Harbor(spec.grader.task_dir, {**spec.grader.settings, "verifier_user": "admin"})
    )
    refused = await grade(admin, "")
    assert (refused.reward, refused.failure_kind) == (0.0, "bad_row") and "root" in refused.details["note"]
