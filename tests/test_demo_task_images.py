"""The formats users bring, run as a user runs them: a folder holding a Harbor task directory and a SWE-bench
Pro row as published (list fields as Python list literals, ``run_script.sh`` + ``parser.py``, the repository
at ``/app`` of its own image, its fix commit in that image's git), both written here, loads, validates in
containers (each gold scores 1, the empty patch 0), and trains one step in ``rollbus demo --tasks FOLDER
--sandbox-backend docker``: the real Claude Code CLI in a container of each task's image, the scripted
engine solving sample 0 of each group and failing sample 1, the grader in fresh containers of the digest
the agent ran.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollbus.cli import main
from rollbus.sandbox import docker_engine, docker_images
from tests.test_demo import demo
from tests.test_task_images_docker import HARBOR_TASK as VALIDATED_TASK

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
SWE_MINI = ROOT / "examples" / "swe-mini"
SWEPRO_IMAGE = "rollbus-test/swepro-intervals:1"
# SWE-bench Pro's images: the repository at /app, its history (the fix commit included) in its own .git
SWEPRO_DOCKERFILE = "FROM {base}\nCOPY repo /app\nWORKDIR /app\n"
HARBOR_NAME = "calc-double"  # the folder's name is the task's (task.toml names none)
# test_task_images_docker's task, its agent given the time a loaded machine needs (the CLI's start alone)
HARBOR_TASK = {**VALIDATED_TASK, "task.toml": VALIDATED_TASK["task.toml"].replace(
    "[agent]\ntimeout_sec = 120", "[agent]\ntimeout_sec = 900")}  # fmt: skip
SWEPRO_ID = "swe-mini__intervals"


def edit_script(path: str, old: str, new: str) -> dict[str, Any]:
    """Claude Code reads ``path``, replaces ``old`` by ``new`` and says it is done."""
    call = "<tool_call>\n<function={}>\n{}</function>\n</tool_call>"
    param = "<parameter={}>\n{}\n</parameter>\n"
    read = call.format("Read", param.format("file_path", path))
    edit = call.format(
        "Edit",
        "".join(
            param.format(k, v) for k, v in (("file_path", path), ("old_string", old), ("new_string", new))
        ),
    )
    return {"turns": [f"Read the file first.\n</think>\n\n{read}", f"Edit it.\n</think>\n\n{edit}",
                      "Done.\n</think>\n\nChanged the file."]}  # fmt: skip


SCRIPTS = {  # NAME.json solves sample 0, NAME@1.json fails sample 1: every group has reward variance
    HARBOR_NAME: edit_script("/app/calc.py", "return x + x + 1", "return 2 * x"),
    f"{HARBOR_NAME}@1": edit_script("/app/calc.py", "return x + x + 1", "return x + x + 2"),
    SWEPRO_ID: edit_script("/app/spans/merge.py", "start < out[-1][1]", "start <= out[-1][1]"),
    f"{SWEPRO_ID}@1": edit_script("/app/spans/merge.py", "start < out[-1][1]", "start < out[-1][1] - 1"),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder: ``calc-double/`` (Harbor; its environment/ is built on first use, content-keyed) and
    ``swepro.jsonl`` (the intervals task as SWE-bench Pro publishes it, its image built here)."""
    built = subprocess.run([sys.executable, str(SWE_MINI / "build.py")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    root = tmp_path_factory.mktemp("tasks")
    client = docker_engine.client()
    context = root / "context"
    shutil.copytree(SWE_MINI / "images" / "intervals", context / "repo", symlinks=True)
    base = docker_images.ensure_base_image(client)
    (context / "Dockerfile").write_text(SWEPRO_DOCKERFILE.format(base=base))
    client.images.build(path=str(context), tag=SWEPRO_IMAGE, rm=True, network_mode="none")
    client.close()
    shutil.rmtree(context)
    ds = root / "ds"
    assert "timeout_sec = 900" in HARBOR_TASK["task.toml"]
    for rel, text in HARBOR_TASK.items():
        (ds / HARBOR_NAME / rel).parent.mkdir(parents=True, exist_ok=True)
        (ds / HARBOR_NAME / rel).write_text(text)
    shutil.copytree(SWE_MINI / "swepro", ds / "swepro")
    row = json.loads((SWE_MINI / "swepro-published.jsonl").read_text().splitlines()[0])
    del row["workdir"]  # SWE-bench Pro's own: /app
    row["image"] = f"docker://{SWEPRO_IMAGE}"
    (ds / "swepro.jsonl").write_text(json.dumps(row) + "\n")
    return ds


def test_a_harbor_task_and_a_swepro_row_validate_and_train_a_step_in_the_demo(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results.jsonl"
    code = main(["validate", str(dataset), "--backend", "docker", "--results", str(results)])
    out = capsys.readouterr().out
    assert code == 0 and f"ok   {HARBOR_NAME}" in out and f"ok   {SWEPRO_ID}" in out, out
    records = {r["task"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert set(records) == {HARBOR_NAME, SWEPRO_ID}, records
    for name, record in records.items():
        gold, empty = record["checks"][:2]
        assert (gold["reward"], empty["reward"]) == (1.0, 0.0), (name, record)

    scripts = tmp_path / "scripts"
    scripts.mkdir()
    for name, script in SCRIPTS.items():
        (scripts / f"{name}.json").write_text(json.dumps(script))
    done, summary, _ = demo(
        tmp_path, "tasks", "--tasks", str(dataset), "--sandbox-backend", "docker", "--script", str(scripts),
        "--steps", "1", "--runner-concurrency", "4", "--state-dir", str(tmp_path / "state"),
    )  # fmt: skip
    tail = done.stdout[-4000:]
    assert summary["rollouts_submitted"] == summary["rollouts_finished"] == 4, (summary, tail)
    assert summary["solved"] == 2 and summary["rollouts_failed"] == 0, (summary, tail)
    assert summary["train_steps"] == 1 and summary["tokens_trained"] > 0, (summary, tail)
    for name in (HARBOR_NAME, SWEPRO_ID):  # in the rollouts table: sample 0 of each solved, sample 1 not
        rewards = dict(re.findall(rf"{re.escape(name)}-\w+-(\d) .*? (\d\.\d\d) ", done.stdout))
        assert rewards == {"0": "1.00", "1": "0.00"}, (name, tail)
