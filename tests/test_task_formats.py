"""The task formats users bring (SWE-bench / SWE-Gym rows, SWE-bench Pro rows, Harbor task directories) read
into the rows rollbus grades: pure readers over plain data, and the loader ``rollbus submit`` uses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollbus.grading import parse_metadata
from rollbus.grading.rows import EvalCmd, Harbor, Swepro
from rollbus.rows import Row, RowKeys, parse_row, read_dataset
from rollbus.services.sandbox_runner.submit import split_rows
from rollbus.task_formats import FormatError, convert_row, detect_row, harbor, load_dataset, swebench, swepro
from rollbus.task_formats.common import row_hash

BASE = "a" * 40
FIX = "b" * 40
TEST_PATCH = "diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n+++ b/tests/test_x.py\n"


def swebench_row(**over: object) -> dict:
    row = {
        "instance_id": "django__django-11099",
        "repo": "django/django",
        "base_commit": BASE,
        "patch": "diff --git a/x.py b/x.py\n",
        "test_patch": TEST_PATCH,
        "problem_statement": "UsernameValidator allows trailing newline",
        "hints_text": "",
        "created_at": "2019-03-20",
        "version": "3.0",
        "FAIL_TO_PASS": json.dumps(["tests/test_x.py::test_new[a b]"]),
        "PASS_TO_PASS": ["tests/test_x.py::test_old"],
        "environment_setup_commit": FIX,
    }
    return {**row, **over}


def swepro_row(**over: object) -> dict:
    row = {
        "instance_id": "instance_ansible__ansible-123",
        "repo": "ansible/ansible",
        "base_commit": BASE,
        "patch": "diff --git a/lib/x.py b/lib/x.py\n",
        "test_patch": "diff --git a/test/x.py b/test/x.py\n",
        "problem_statement": "It breaks.",
        "requirements": "Must not break.",
        "interface": "def fixed() -> None",
        "repo_language": "python",
        "fail_to_pass": "['test/x.py::test_a', 'test/x.py::test_b']",
        "pass_to_pass": "[]",
        "selected_test_files_to_run": "['test/x.py']",
        "before_repo_set_cmd": f"git reset --hard {BASE}\ngit clean -fd\ngit checkout {BASE}\n"
        f"git checkout {FIX} -- test/x.py",
        "dockerhub_tag": "ansible.ansible-123",
    }
    return {**row, **over}


# -- SWE-bench / SWE-Gym ---------------------------------------------------------------------------------


def test_a_swebench_row_becomes_a_graded_rollbus_row() -> None:
    out = swebench.read_row(swebench_row(), revision="v1.1")
    meta = out["metadata"]
    assert out["prompt"] == "UsernameValidator allows trailing newline" and out["label"].startswith("diff")
    assert meta["image"] == "xingyaoww/sweb.eval.x86_64.django_s_django-11099:latest"
    assert meta["workdir"] == "/testbed" and meta["test_patch"] == TEST_PATCH
    assert meta["fail_to_pass"] == ["tests/test_x.py::test_new[a b]"]
    assert meta["eval_cmd"].endswith("'tests/test_x.py::test_new[a b]' tests/test_x.py::test_old")
    assert meta["source"] == {"format": "swebench", "revision": "v1.1", "row_hash": row_hash(swebench_row())}
    kept = (meta["version"], meta["created_at"], meta["environment_setup_commit"])
    assert kept == ("3.0", "2019-03-20", FIX)
    spec = parse_metadata(meta, Path("/"))
    assert spec.container_image == meta["image"] and isinstance(spec.grader, EvalCmd)
    assert "tests/test_x.py" in spec.test_files() and spec.test_patch_files() == ("tests/test_x.py",)


def test_swebench_lists_read_from_lists_or_json_strings_and_the_image_from_the_row() -> None:
    as_lists = swebench.read_row(swebench_row(FAIL_TO_PASS=["t.py::a"], PASS_TO_PASS="[]"))["metadata"]
    assert (as_lists["fail_to_pass"], as_lists["pass_to_pass"]) == (["t.py::a"], [])
    for key in swebench.IMAGE_KEYS:
        assert swebench.read_row(swebench_row(**{key: "my/img:1"}))["metadata"]["image"] == "my/img:1"
    own = swebench.read_row(swebench_row(eval_cmd="./tests/runtests.py x", pre_commands=[]))["metadata"]
    assert own["eval_cmd"] == "./tests/runtests.py x" and own["pre_commands"] == []
    image = swebench.swegym_image("Astropy__Astropy-1")
    assert image == "xingyaoww/sweb.eval.x86_64.astropy_s_astropy-1:latest"


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"instance_id": ""}, "instance_id"),
        ({"test_patch": None}, "test_patch"),
        ({"base_commit": 5}, "base_commit"),
        ({"FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": "[]"}, "FAIL_TO_PASS is empty"),
        ({"PASS_TO_PASS": [1]}, "PASS_TO_PASS"),
        ({"pre_commands": "echo"}, "pre_commands"),
        ({"eval_cmd": ["x"]}, "eval_cmd"),
    ],
)
def test_a_bad_swebench_row_names_its_field(over: dict, field: str) -> None:
    with pytest.raises(FormatError, match=field):
        swebench.read_row(swebench_row(**over))


# -- SWE-bench Pro ---------------------------------------------------------------------------------------


def test_a_swepro_row_as_published_becomes_a_swepro_graded_row(tmp_path: Path) -> None:
    out = swepro.read_row(swepro_row())
    meta = out["metadata"]
    assert out["prompt"] == (
        "It breaks.\n\nRequirements:\nMust not break.\n\nNew interfaces introduced:\ndef fixed() -> None"
    )
    assert meta["problem_statement"] == out["prompt"] and out["label"].startswith("diff")
    assert (meta["image"], meta["workdir"]) == ("jefzda/sweap-images:ansible.ansible-123", "/app")
    assert meta["swepro"]["fail_to_pass"] == ["test/x.py::test_a", "test/x.py::test_b"]
    assert meta["swepro"]["run_script_path"] == "run_scripts/instance_ansible__ansible-123/run_script.sh"
    spec = parse_metadata(meta, tmp_path)
    assert isinstance(spec.grader, Swepro)
    assert spec.grader.restore_cmd == f"git checkout {FIX} -- test/x.py"  # only the last line is acted on
    assert spec.grader.parser_script == tmp_path / "run_scripts/instance_ansible__ansible-123/parser.py"
    assert spec.grader.selected_test_files == ("test/x.py",)
    bare = swepro.read_row(swepro_row(requirements="", interface=None))
    assert bare["prompt"] == "It breaks."


def test_swepro_list_literals_are_read_never_evaluated(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hostile = f"__import__('os').system('touch {marker}')"
    with pytest.raises(FormatError, match="fail_to_pass"):
        swepro.read_row(swepro_row(fail_to_pass=hostile))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"dockerhub_tag": ""}, "dockerhub_tag"),
        ({"before_repo_set_cmd": "git checkout abc\nrm -rf /"}, "before_repo_set_cmd"),
        ({"fail_to_pass": "[]"}, "fail_to_pass is empty"),
        ({"pass_to_pass": "[1, 2]"}, "pass_to_pass"),
        ({"instance_id": "../x"}, "instance_id"),
        ({"selected_test_files_to_run": "{'a': 1}"}, "selected_test_files_to_run"),
    ],
)
def test_a_bad_swepro_row_names_its_field(over: dict, field: str) -> None:
    with pytest.raises(FormatError, match=field):
        swepro.read_row(swepro_row(**over))


# -- Harbor ----------------------------------------------------------------------------------------------

TOML = """\
version = "1.0"
[metadata]
author_name = "someone"
difficulty = "easy"
[verifier]
timeout_sec = 120.0
env = { STRICT = "1" }
[agent]
timeout_sec = 300
[solution]
env = { HINT = "x" }
[environment]
build_timeout_sec = 900
cpus = 2
memory_mb = 4096
storage_mb = 2048
allow_internet = false
"""


def harbor_files(toml: str = TOML, **over: bytes | None) -> dict[str, bytes]:
    files = {
        "task.toml": toml.encode(),
        "instruction.md": b"Write hello.txt in /app.\n",
        "environment/Dockerfile": b"FROM python:3.11-slim-bookworm\nWORKDIR /srv\nRUN true\nWORKDIR /app\n",
        "tests/test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
        "tests/test_outputs.py": b"def test_x(): pass\n",
        "solution/solve.sh": b"#!/bin/bash\necho hello > /app/hello.txt\n",
    }
    files.update({k: v for k, v in over.items() if v is not None})
    for key in [k for k, v in over.items() if v is None]:
        files.pop(key, None)
    return files


def test_a_harbor_task_honours_its_phases_and_keeps_what_it_ignores() -> None:
    out = harbor.read_task("hello", harbor_files(), "/data/hello", revision="tb-2.1")
    meta, h = out["metadata"], out["metadata"]["harbor"]
    assert out["prompt"] == "Write hello.txt in /app.\n" and out["label"] is None
    assert meta["instance_id"] == "hello" and meta["workdir"] == "/app"  # the Dockerfile's last WORKDIR
    assert meta["image"].startswith("docker://rollbus-harbor/hello:") and h["build_image"] in meta["image"]
    assert (meta["agent_timeout_sec"], meta["grade_timeout_sec"], h["build_timeout_sec"]) == (300, 120, 900)
    assert meta["resources"] == {"cpus": 2.0, "memory_mb": 4096, "storage_mb": 2048}
    assert h["network"] == {"agent": "adapter-only", "verifier": "no-network"}
    assert (h["verifier_env"], h["solution_env"]) == ({"STRICT": "1"}, {"HINT": "x"})
    assert (h["solution"], h["tests_dir"], h["task_dir"]) == ("solution/solve.sh", "tests", "/data/hello")
    assert h["reward_files"] == ["/logs/verifier/reward.txt", "/logs/verifier/reward.json"]
    assert h["ignored"] == ["metadata"]
    assert meta["source"]["format"] == "harbor" and meta["source"]["revision"] == "tb-2.1"
    spec = parse_metadata(meta, Path("/"))
    assert isinstance(spec.grader, Harbor) and spec.timeout_s == 120 and spec.container_image is not None


def test_harbor_schema_1_1_and_1_4_spellings() -> None:
    toml = """\
schema_version = "1.1"
artifacts = ["/app/out"]
[task]
name = "org/Task One"
description = "d"
keywords = ["k"]
[agent]
user = "agent"
network_mode = "public"
[verifier]
user = "tester"
[environment]
docker_image = "ubuntu:24.04"
memory = "1.5G"
storage = "512M"
gpus = 0
"""
    meta = harbor.read_task("dir", harbor_files(toml, **{"environment/Dockerfile": None}), "/t")["metadata"]
    where = (meta["instance_id"], meta["image"], meta["workdir"])
    assert where == ("org/Task One", "docker://ubuntu:24.04", "/app")
    assert meta["user"] == "agent" and meta["harbor"]["verifier_user"] == "tester"
    assert meta["resources"]["memory_mb"] == 1536 and meta["resources"]["storage_mb"] == 512
    assert meta["harbor"]["network"] == {"agent": "adapter-only", "verifier": "public"}
    assert meta["harbor"]["ignored"] == ["artifacts", "task.description", "task.keywords"]
    assert meta["harbor"]["build_image"] is None


@pytest.mark.parametrize(
    ("toml", "over", "field"),
    [
        (TOML + "gpus = 1\n", {}, "environment.gpus"),
        (TOML + '[[environment.mcp_servers]]\nname = "x"\n', {}, "environment.mcp_servers"),
        ('version = "1.0"\n[[steps]]\nname = "a"\n', {}, r"\[\[steps\]\]"),
        ('version = "1.0"\n[agent]\nnetwork_mode = "allowlist"\n', {}, "agent.network_mode = 'allowlist'"),
        ('version = "1.0"\n[verifier]\nnetwork_mode = "weird"\n', {}, "verifier.network_mode"),
        ('version = "1.0"\n[verifier]\nnetwork_mode = "public"\n', {}, "verifier.network_mode = 'public'"),
        ('version = "1.0"\n[verifier]\nuser = "root"\n', {}, "verifier.user = 'root'"),
        ('version = "1.0"\n[verifier]\nuser = 0\n', {}, "verifier.user = '0'"),
        ('version = "1.0"\n[verifier]\nuser = "0:0"\n', {}, "verifier.user = '0:0'"),
        ('version = "1.0"\n[environment]\nenvironment_mode = "separate"\n', {}, "separate verifier"),
        ('version = "1.0"\n[verifier.environment]\ncpus = 1\n', {}, "separate verifier"),
        ('version = "2.0"\n', {}, "schema '2.0'"),
        ("version = [", {}, "task.toml"),
        (TOML, {"environment/Dockerfile": None, "environment/docker-compose.yaml": b"x"}, "docker-compose"),
        (TOML, {"environment/Dockerfile": None}, "no environment/Dockerfile"),
        (TOML, {"tests/test.sh": None}, "tests/test.sh"),
        (TOML, {"instruction.md": b"  \n"}, "instruction.md is empty"),
        (TOML.replace("cpus = 2", "cpus = -1"), {}, "cpus"),
        (TOML.replace("memory_mb = 4096", 'memory = "lots"'), {}, "memory"),
        (TOML.replace('env = { STRICT = "1" }', "env = [1]"), {}, r"\[verifier\] env"),
        (TOML.replace("allow_internet = false", "allow_internet = 1"), {}, "allow_internet"),
    ],
)
def test_harbor_refuses_what_it_cannot_honour_by_name(toml: str, over: dict, field: str) -> None:
    with pytest.raises(FormatError, match=field):
        harbor.read_task("t", harbor_files(toml, **over), "/t")


def test_harbor_row_hash_follows_every_file() -> None:
    one = harbor.read_task("t", harbor_files(), "/t")["metadata"]
    again = harbor.read_task("t", harbor_files(), "/elsewhere")["metadata"]
    changed = harbor.read_task("t", harbor_files(**{"tests/test_outputs.py": b"x"}), "/t")["metadata"]
    assert one["source"]["row_hash"] == again["source"]["row_hash"] != changed["source"]["row_hash"]
    assert one["image"] != changed["image"]  # a changed task is a new local image tag


# -- detection and loading -------------------------------------------------------------------------------


def test_each_row_shape_is_detected_and_an_unknown_one_is_named() -> None:
    assert detect_row({"prompt": "p", "metadata": {}}) == "rollbus"
    assert detect_row({"question": "p"}, ("question", "meta")) == "rollbus"
    assert detect_row(swebench_row()) == "swebench"
    assert detect_row(swepro_row()) == "swepro"
    with pytest.raises(FormatError, match="unknown row shape.*keys a, b"):
        detect_row({"a": 1, "b": 2})
    with pytest.raises(FormatError, match="not a row format"):
        convert_row({}, "harbor")


def write_harbor(root: Path, name: str, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / name / rel).write_bytes(data)
    return root / name


def test_a_mixed_jsonl_loads_row_by_row_with_each_error_placed(tmp_path: Path) -> None:
    own = {"prompt": "p", "metadata": {"image": "repo", "workdir": "/w", "eval_cmd": "true"}}
    bad_swebench = swebench_row(FAIL_TO_PASS="[]")
    lines = [json.dumps(own), json.dumps(swebench_row()), "", json.dumps(swepro_row()), "{oops",
             json.dumps({"what": 1}), json.dumps([1]), json.dumps(bad_swebench)]  # fmt: skip
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("\n".join(lines) + "\n")
    loaded = load_dataset(dataset, revision="r1")
    assert [x.line for x in loaded] == [1, 2, 4, 5, 6, 7, 8]
    errors = {x.line: x.error for x in loaded if x.error}
    assert set(errors) == {5, 6, 7, 8} and "invalid JSON" in errors[5] and "unknown row shape" in errors[6]
    assert "JSON object" in errors[7] and "FAIL_TO_PASS" in errors[8]
    sources = [json.loads(x.text)["metadata"]["source"] for x in loaded if x.text]
    assert [s["format"] for s in sources] == ["rollbus", "swebench", "swepro"]
    assert {s["revision"] for s in sources} == {"r1"}
    rows, bad = split_rows(dataset, RowKeys(), None, "r1")
    assert [r.instance_id for r in rows] == ["row1", "django__django-11099", "instance_ansible__ansible-123"]
    assert [where for where, _ in bad] == [f"{dataset}:{n}" for n in (5, 6, 7, 8)]
    assert rows[0].metadata["image"] == str(tmp_path / "repo")  # paths still resolve against the file
    assert rows[2].metadata["swepro"]["run_script_path"].startswith(str(tmp_path / "run_scripts"))
    forced = load_dataset(dataset, "swepro")
    assert [x.line for x in forced if x.text] == [4]  # --format: every row read as that format


def test_harbor_folders_load_as_one_task_or_a_dataset_of_them(tmp_path: Path) -> None:
    one = write_harbor(tmp_path / "ds", "hello", harbor_files())
    write_harbor(tmp_path / "ds", "gpu", harbor_files(TOML + "gpus = 2\n"))
    (tmp_path / "ds" / "dataset.toml").write_text('name = "ds"\n')
    (tmp_path / "ds" / "notes").mkdir()
    single = load_dataset(one)
    assert len(single) == 1 and json.loads(single[0].text)["metadata"]["harbor"]["task_dir"] == str(one)
    many = load_dataset(tmp_path / "ds")
    assert [(Path(x.where).name, x.error is None) for x in many] == [("gpu", False), ("hello", True)]
    assert "environment.gpus" in many[0].error
    items = list(read_dataset(tmp_path / "ds", RowKeys()))
    assert isinstance(items[1], Row) and items[1].metadata["image"].startswith("docker://rollbus-harbor/")
    assert items[0][0].endswith("gpu")
    with pytest.raises(FormatError, match="no Harbor task"):
        load_dataset(tmp_path / "ds" / "notes")
    with pytest.raises(FormatError, match="without \\*.jsonl files: its swebench rows"):
        load_dataset(tmp_path / "ds", "swebench")
    with pytest.raises(FormatError, match="unknown format"):
        load_dataset(one, "csv")


def test_a_folder_of_task_folders_and_jsonl_files_is_one_dataset(tmp_path: Path) -> None:
    """``rollbus submit`` / ``demo --tasks`` / ``validate`` given one folder read its Harbor tasks, then every
    ``*.jsonl`` file's rows, numbered through the folder (a row with no instance id is named by it);
    ``--format`` picks one kind."""
    write_harbor(tmp_path / "ds", "hello", harbor_files())
    own = {"prompt": "p", "metadata": {"image": "repo", "workdir": "/w", "eval_cmd": "true"}}
    (tmp_path / "ds" / "a.jsonl").write_text(json.dumps(swepro_row()) + "\n" + json.dumps(own) + "\n")
    (tmp_path / "ds" / "b.jsonl").write_text(json.dumps(own) + "\n")
    (tmp_path / "ds" / "notes.txt").write_text("not a dataset\n")
    loaded = load_dataset(tmp_path / "ds")
    assert [Path(x.where).name for x in loaded] == ["hello", "a.jsonl:1", "a.jsonl:2", "b.jsonl:1"]
    assert [x.line for x in loaded] == [1, 2, 3, 4] and all(x.error is None for x in loaded)
    rows, bad = split_rows(tmp_path / "ds", RowKeys())
    assert [r.instance_id for r in rows] == ["hello", "instance_ansible__ansible-123", "row3", "row4"]
    assert not bad and rows[2].metadata["image"] == str(tmp_path / "ds" / "repo")  # beside the files
    formats = [json.loads(x.text)["metadata"]["source"]["format"] for x in loaded]
    assert formats == ["harbor", "swepro", "rollbus", "rollbus"]
    assert [Path(x.where).name for x in load_dataset(tmp_path / "ds", "harbor")] == ["hello"]
    forced = load_dataset(tmp_path / "ds", "swepro")
    assert [x.error is None for x in forced] == [True, False, False]  # every .jsonl row read as that format


def test_a_converted_row_passes_submits_own_checks(tmp_path: Path) -> None:
    for row in (swebench.read_row(swebench_row()), swepro.read_row(swepro_row())):
        parsed = parse_row(json.dumps(row), 1, RowKeys(), tmp_path)
        assert parsed.metadata["source"] == row["metadata"]["source"]  # nothing lost on the way in


def test_rollbus_grade_reads_a_swebench_or_swepro_row_as_submit_does(tmp_path: Path) -> None:
    from rollbus.services.grader.cli import read_row

    dataset = tmp_path / "d.jsonl"
    dataset.write_text(json.dumps(swebench_row()) + "\n" + json.dumps(swepro_row()) + "\n")
    first = read_row(dataset)
    assert first["metadata"]["source"]["format"] == "swebench"
    assert first["metadata"]["test_patch"] == TEST_PATCH
    pro = read_row(dataset, "instance_ansible__ansible-123")
    assert pro["metadata"]["swepro"]["fail_to_pass"] == ["test/x.py::test_a", "test/x.py::test_b"]
    dataset.write_text('{"what": 1}\n')
    with pytest.raises(ValueError, match="d.jsonl:1: unknown row shape"):
        read_row(dataset)
