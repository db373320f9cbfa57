"""A row names its image (host path or container reference), workdir and agent user; the image digest rides
on the diff and reward events."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rollbus import codec
from rollbus.grading import BadRow, GradeConfig, GradeResult, grade, parse_metadata
from rollbus.grading import verdict as v
from rollbus.grading.backends import GRADE_BACKENDS
from rollbus.grading.rows import absolute_paths
from rollbus.rows import RowError, RowKeys, parse_row
from rollbus.sandbox import SandboxError, SandboxSpec, create_local
from rollbus.sandbox.limits import MIB, Limits
from rollbus.services.grader.core import grade_diff, grade_row, reward_record
from rollbus.services.sandbox_runner.outcome import AttemptResult, diff_event
from rollbus.services.sandbox_runner.rollout import agent_timeout, sandbox_spec
from rollbus.services.sandbox_runner.settings import RunnerSettings
from rollbus.task_image import (
    ImageFieldError,
    image_kind,
    parse_digest,
    parse_image,
    parse_user,
    parse_workdir,
    row_limits,
)
from rollbus.task_image import pinned as pinned_ref

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("images/sum-to", "path"),  # how swe-mini rows have always named their image
        ("/abs/repo", "path"),
        ("./repo", "path"),
        ("../x.tar.gz", "path"),
        ("repo.tar", "path"),
        ("python:3.11-slim-bookworm", "container"),
        ("xingyaoww/sweb.eval.x86_64.django_s_django-11099:latest", "container"),
        ("jefzda/sweap-images:ansible.ansible-abc123", "container"),
        ("localhost:5000/team/img:1", "container"),
        (f"ubuntu@{DIGEST}", "container"),
        ("docker://ubuntu", "container"),  # explicit: a tagless reference
        ("Upper/Case:tag", "path"),  # not a reference (upper case): a path
    ],
)
def test_an_image_is_a_path_or_a_container_reference_by_its_shape(text: str, kind: str) -> None:
    assert image_kind(text) == kind


def test_a_container_reference_keeps_its_pinned_digest_and_pins_a_regrade() -> None:
    ref = parse_image(f"docker://reg.example:5000/a/b:1.0@{DIGEST}")
    assert (ref.kind, ref.text, ref.digest) == ("container", f"reg.example:5000/a/b:1.0@{DIGEST}", DIGEST)
    assert pinned_ref(parse_image("python:3.11"), DIGEST) == f"python@{DIGEST}"
    assert pinned_ref(parse_image("images/x"), DIGEST) == "images/x"  # a path has no digest to pin
    assert pinned_ref(parse_image("python:3.11"), None) == "python:3.11"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "non-empty string"),
        ("", "non-empty string"),
        (3, "non-empty string"),
        (" python:3.11", "whitespace"),
        ("docker://Bad Name:1", "not a container image reference"),
        ("docker://a:b:c", "not a container image reference"),
    ],
)
def test_a_bad_image_names_the_field(value: object, message: str) -> None:
    with pytest.raises(ImageFieldError, match=rf"metadata\.image .*{message}|metadata\.image {message}"):
        parse_image(value)


def test_workdir_user_and_digest_are_checked_and_name_their_field() -> None:
    assert parse_workdir("/testbed") == "/testbed"
    for bad in ("testbed", "/a/../etc", None, "/a\nb"):
        with pytest.raises(ImageFieldError, match="metadata.workdir"):
            parse_workdir(bad)
    assert [parse_user(u) for u in ("agent", "1000", "1000:1000", 0, None, "")] == [
        "agent", "1000", "1000:1000", "0", None, None,
    ]  # fmt: skip
    for bad in ("Root", "a b", "1000:x", -1, True, "x" * 40, "a;rm"):
        with pytest.raises(ImageFieldError, match="metadata.user"):
            parse_user(bad)
    assert parse_digest(DIGEST) == DIGEST and parse_digest(None) is None
    with pytest.raises(ImageFieldError, match="image_digest"):
        parse_digest("sha256:short")


def row_text(**metadata: object) -> str:
    base = {"image": "images/x", "workdir": "/workspace", "eval_cmd": "true"}
    return json.dumps({"prompt": "fix it", "metadata": {**base, **metadata}})


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({"user": "not a user"}, "metadata.user"),
        ({"workdir": "/a/../b"}, "metadata.workdir"),
        ({"image": "docker://UPPER:1"}, "metadata.image"),
    ],
)
def test_submit_reports_the_bad_field_of_a_row(metadata: dict, field: str, tmp_path: Path) -> None:
    with pytest.raises(RowError, match=field.replace(".", r"\.")):
        parse_row(row_text(**metadata), 3, RowKeys(), tmp_path)


def test_a_container_row_keeps_its_reference_user_and_every_field(tmp_path: Path) -> None:
    row = parse_row(row_text(image="python:3.11", user="1000:1000", workdir="/testbed", extra=[1]), 1,
                    RowKeys(), tmp_path)  # fmt: skip
    assert row.metadata["image"] == "python:3.11"  # not made a host path under the dataset's directory
    assert row.metadata["extra"] == [1] and row.metadata["user"] == "1000:1000"
    path_row = parse_row(row_text(), 1, RowKeys(), tmp_path)
    assert path_row.metadata["image"] == str(tmp_path / "images/x")
    spec = parse_metadata(row.metadata, tmp_path)
    assert (spec.container_image, spec.user, spec.workdir) == ("python:3.11", "1000:1000", "/testbed")
    assert parse_metadata(path_row.metadata, tmp_path).container_image is None
    assert absolute_paths({"image": "docker://python"}, tmp_path)["image"] == "docker://python"
    with pytest.raises(BadRow, match="metadata.user"):
        parse_metadata({**row.metadata, "user": "$(id)"}, tmp_path)


def test_the_runner_asks_for_the_rows_container_image_and_user() -> None:
    settings = RunnerSettings.load({})
    metadata = {"image": "python:3.11", "workdir": "/testbed", "user": "agent"}
    spec = sandbox_spec(settings, metadata, {"/bin/true": "/opt/claude-code/claude"}, "s-1")
    assert (spec.container_image, spec.user, spec.workdir) == ("python:3.11", "agent", "/testbed")


def test_the_local_backend_refuses_a_container_image_by_name(tmp_path: Path) -> None:
    spec = SandboxSpec(image=Path("python:3.11"), container_image="python:3.11")
    with pytest.raises(SandboxError, match="container image") as caught:
        asyncio.run(create_local(spec, scratch_root=tmp_path))
    assert caught.value.failure_kind == "image_error" and list(tmp_path.iterdir()) == []


def test_the_local_grader_names_a_container_image_it_cannot_grade(tmp_path: Path) -> None:
    spec = parse_metadata({"image": "python:3.11", "workdir": "/testbed", "eval_cmd": "true"}, tmp_path)
    result = asyncio.run(grade(spec, ""))
    assert result.failure_kind == v.SANDBOX_FAILED and "container image" in result.details["note"]


def test_the_digest_rides_from_the_diff_to_the_reward_and_defaults_to_null() -> None:
    task = {"rollout_id": "r", "metadata": "{}"}
    assert diff_event(task, AttemptResult("a")).image_digest is None  # bwrap: no container digest
    event = diff_event(task, AttemptResult("a", image_digest=DIGEST))
    assert event.image_digest == DIGEST
    decoded = codec.decode(codec.encode("diff", event))
    assert decoded.record["image_digest"] == DIGEST
    graded = GradeResult(1.0, True, True, None, details={"image_digest": DIGEST})
    assert reward_record(event, graded).image_digest == DIGEST
    assert reward_record(event, GradeResult(0.0, False, True, None)).image_digest is None


def test_a_malformed_digest_on_a_diff_is_a_bad_row_not_a_crash(tmp_path: Path) -> None:
    row = {"metadata": {"image": "/none", "workdir": "/w", "eval_cmd": "true"}}
    result = asyncio.run(grade_row(row, "", tmp_path, GradeConfig(), image_digest="sha256:nope"))
    assert result.failure_kind == v.BAD_ROW and "image_digest" in result.details["note"]


def test_older_diff_and_reward_events_read_back_with_no_digest() -> None:
    for event_type, old in (("diff", 3), ("reward", 2)):
        schema = codec.schema(event_type, old)
        assert "image_digest" not in [f["name"] for f in schema["fields"]]
        latest = codec.schema(event_type)
        field = next(f for f in latest["fields"] if f["name"] == "image_digest")
        assert field["default"] is None and latest["version"] == old + 1


def test_a_rows_resources_and_agent_timeout_narrow_the_operators_limits() -> None:
    base = Limits(memory_bytes=4096 * MIB, cpus=2.0, disk_bytes=None, wall_s=1800.0)
    asked = {"resources": {"cpus": 1, "memory_mb": 512, "storage_mb": 100}, "agent_timeout_sec": 60}
    got = row_limits(base, asked)
    assert (got.cpus, got.memory_bytes, got.disk_bytes, got.wall_s) == (1, 512 * MIB, 100 * MIB, 60)
    greedy = {"resources": {"cpus": 64, "memory_mb": 10**6}, "agent_timeout_sec": 10**6}
    capped = row_limits(base, greedy)  # never more than the operator allows
    assert (capped.cpus, capped.memory_bytes, capped.wall_s) == (2.0, 4096 * MIB, 1800.0)
    junk = {"resources": {"cpus": True, "memory_mb": "lots", "storage_mb": -1}, "agent_timeout_sec": 0}
    assert row_limits(base, junk) == base and row_limits(base, {"resources": [1]}) == base
    settings = RunnerSettings.load({})
    assert agent_timeout(settings, {"agent_timeout_sec": 5}) == 5
    assert agent_timeout(settings, {}) == settings.agent_timeout


SEEN: list[Any] = []


async def recording_grade(spec: Any, patch: bytes | str, config: Any) -> GradeResult:
    """Stands in for a container backend's ``grade`` (the contract a backend module keeps): it is handed the
    diff's digest to pin, and reports the digest it graded in."""
    SEEN.append(spec)
    return GradeResult(1.0, True, True, None, details={"image_digest": spec.image_digest})


def test_a_regrade_hands_the_diffs_digest_to_the_backend_by_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(GRADE_BACKENDS, "docker", f"{__name__}:recording_grade")
    metadata = {"image": "python:3.11", "workdir": "/testbed", "eval_cmd": "pytest"}
    task = {"rollout_id": "r", "metadata": json.dumps(metadata)}
    diff = diff_event(task, AttemptResult("a", image_digest=DIGEST))
    result = asyncio.run(grade_diff(diff, tmp_path, GradeConfig(backend="docker")))
    assert SEEN[-1].image_digest == DIGEST and SEEN[-1].container_image == "python:3.11"
    assert pinned_ref(parse_image(SEEN[-1].container_image), SEEN[-1].image_digest) == f"python@{DIGEST}"
    assert reward_record(diff, result).image_digest == DIGEST
    local = asyncio.run(grade_diff(diff, tmp_path, GradeConfig()))  # bwrap cannot run it, and says so
    assert local.failure_kind == v.SANDBOX_FAILED and reward_record(diff, local).image_digest is None


def test_on_docker_a_path_row_keeps_its_tree_and_an_untagged_name_is_a_container_image(
    tmp_path: Path,
) -> None:
    """A host directory stays a path (the docker backend runs it in an image of that tree); a name that is no
    host path (``ubuntu``, untagged) is the engine's image, as before."""
    settings = RunnerSettings.load({"backend": "docker"})
    tree = sandbox_spec(settings, {"image": str(tmp_path)}, {}, "s-1")
    assert (tree.container_image, tree.image) == (None, tmp_path)
    named = sandbox_spec(settings, {"image": "ubuntu"}, {}, "s-2")
    assert named.container_image == "ubuntu"
