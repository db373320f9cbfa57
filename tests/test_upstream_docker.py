"""A real upstream project at a known bug, in an image built here, solved by the real CLIs in containers.

The project is examples/upstream's ``parse`` (release 1.20.1 from its PyPI sdist, a hyphen in a field name is
not recognised; 1.20.2 fixes it and adds the two tests the grader copies in). Its image is SWE-bench's shape:
``FROM`` the local ``python:3.11-slim-bookworm`` equivalent, the test runner installed from PyPI by pip during
``docker build --network host``, the release as a git repository at ``/testbed``; tagged by a content key (the
base's tag, the Dockerfile and the repository's commit), so a second run builds nothing. Claude Code and
Codex each run in a container of it (``--backend docker``) against the scripted engine, and the grader grades
each diff in fresh network-less containers of the digest the agent ran: Claude Code's fix 1, its partial
attempt 0, Codex's fix 1; every sampled token of each is trained (loss mask 1), nothing else.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rollbus.grading import GradeConfig
from rollbus.rows import RowKeys, parse_row, tasks_for
from rollbus.services.grader.core import grade_diff
from rollbus.services.sandbox_runner.main import run_one
from rollbus.services.sandbox_runner.settings import RunnerSettings
from tests.e2e_support import Rig, Rollout, rollout_events
from tests.test_upstream_task import UPSTREAM, load_build

pytestmark = [pytest.mark.kafka, pytest.mark.docker]

WORKDIR = "/testbed"
PYTEST = "pytest==8.3.5"  # the image's test runner (and its dependencies), from PyPI
DOCKERFILE = f"""ARG PYTHON_BASE
FROM ${{PYTHON_BASE}}
RUN python3 -m pip install --no-cache-dir --disable-pip-version-check {PYTEST}
COPY repo {WORKDIR}
WORKDIR {WORKDIR}
"""
CLAUDE, CLAUDE_PARTIAL, CODEX = "parse-hyphen-claude", "parse-hyphen-claude-partial", "parse-hyphen-codex"

# the fix release's library change, as the edits an agent makes (the version bump and copy() aside)
OLD_RE = r'PARSE_RE = re.compile(r"({{|}}|{\w*(?:\.\w+|\[[^]]+])*(?::[^}]+)?})")'
NEW_RE = r'PARSE_RE = re.compile(r"({{|}}|{[\w-]*(?:\.[\w-]+|\[[^]]+])*(?::[^}]+)?})")'
# whole lines: apply_patch matches lines (trimmed where it must) and puts back what its + lines hold
OLD_GROUP = '        group = field.replace(".", "_").replace("[", "_").replace("]", "_")'
NEW_GROUP = OLD_GROUP + '.replace("-", "_")'
OLD_COLLISION = '            elif "_" in field:\n                group = field.replace("_", "_" * n)'
NEW_COLLISION = (
    OLD_COLLISION + '\n            elif "-" in field:\n                group = field.replace("-", "_" * n)'
)
FIX = ((OLD_RE, NEW_RE), (OLD_GROUP, NEW_GROUP), (OLD_COLLISION, NEW_COLLISION))


def tool_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def claude_script(edits: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    """Claude Code reads parse.py, then makes each edit with its Edit tool."""
    path = f"{WORKDIR}/parse.py"
    turns = [f"Read the parser first.\n</think>\n\n{tool_call('Read', file_path=path)}"]
    turns += [f"Edit it.\n</think>\n\n{tool_call('Edit', file_path=path, old_string=old, new_string=new)}"
              for old, new in edits]  # fmt: skip
    return {"turns": [*turns, "Done.\n</think>\n\nHyphenated field names now parse."]}


def codex_script() -> dict[str, Any]:
    """Codex finds the lines with its shell, then patches them with apply_patch."""
    lines = lambda sign, text: "".join(f"{sign}{line}\n" for line in text.splitlines())  # noqa: E731
    hunks = "".join("@@\n" + lines("-", old) + lines("+", new) for old, new in FIX)
    patch = f"*** Begin Patch\n*** Update File: parse.py\n{hunks}*** End Patch"
    find = tool_call("exec_command", cmd="grep -n 'PARSE_RE = \\|def _to_group_name' parse.py")
    return {"turns": [f"Find the parser.\n</think>\n\n{find}",
                      f"Patch it.\n</think>\n\n{tool_call('apply_patch', input=patch)}",
                      "Done.\n</think>\n\nHyphenated field names now parse."]}  # fmt: skip


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """The upstream row (tasks.jsonl checked against the sdists) and its image, built if its key is new."""
    from rollbus.local_images.build import content_key, ensure_image
    from rollbus.local_images.python_base import ensure_python_base
    from rollbus.sandbox import docker_engine, docker_images

    (row,) = load_build().build()
    repo = UPSTREAM / row["metadata"]["image"]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    client = docker_engine.client()
    python = ensure_python_base(client, docker_images.ensure_base_image(client))
    tag = f"rollbus-upstream/parse:{content_key(python, DOCKERFILE, head)}"
    recipe = tmp_path_factory.mktemp("upstream-recipe")
    (recipe / "Dockerfile").write_text(DOCKERFILE)
    ensure_image(client, tag, recipe, buildargs={"PYTHON_BASE": python},
                 add=lambda context: shutil.copytree(repo, context / "repo", symlinks=True))  # fmt: skip
    client.close()
    return row, tag


@pytest.fixture(scope="module")
def rig(session_rig: Rig, tmp_path_factory: pytest.TempPathFactory) -> Rig:
    scripts = tmp_path_factory.mktemp("upstream-scripts")
    for name, script in ((CLAUDE, claude_script(FIX)), (CLAUDE_PARTIAL, claude_script(FIX[:1])),
                         (CODEX, codex_script())):  # fmt: skip
        (scripts / f"{name}.json").write_text(json.dumps(script))
    session_rig.ensure_adapter()
    session_rig.use_script(scripts)
    return session_rig


async def run_in_image(
    rig: Rig, upstream: tuple[dict[str, Any], str], instance: str, agent: str, tmp_path: Path
) -> tuple[dict[str, Any], Any, Rollout]:
    """One rollout of the row (as ``instance``, under ``agent``) in a container of the image, graded in
    containers of the digest it ran: the diff, the grade and its events."""
    row, image = upstream
    metadata = {**row["metadata"], "instance_id": instance, "image": f"docker://{image}", "workdir": WORKDIR,
                "agent": agent}  # fmt: skip
    (task,) = tasks_for(parse_row(json.dumps({**row, "metadata": metadata}), 1, RowKeys(), UPSTREAM), 1)
    options = {"adapter_url": rig.url, "admin_token": rig.admin_token, "backend": "docker"}
    diff = await run_one(RunnerSettings.load({**options, "sandbox_root": tmp_path / "sandboxes"}), task)
    assert diff["failure_kind"] is None and diff["exit_status"] == 0, diff["error"]
    assert str(diff["image_digest"]).startswith("sha256:")
    graded = await grade_diff(diff, UPSTREAM, GradeConfig(backend="docker"))
    assert graded.details["image_digest"] == diff["image_digest"], graded  # the bytes the agent ran
    turns = await rollout_events(rig.bootstrap, rig.namespace, "turns", diff["rollout_id"])
    sessions = await rollout_events(rig.bootstrap, rig.namespace, "sessions", diff["rollout_id"])
    rollout = Rollout(diff["rollout_id"], None, Path(), turns, sessions)  # type: ignore[arg-type]
    return diff, graded, rollout


def assert_every_sampled_token_at_mask_1(rollout: Rollout, reward: float, turns: int) -> None:
    """The main chain's ``turns`` sampled outputs are all trained, with their logprobs; nothing else."""
    sampled = [t for t in rollout.turns if t["chain_kind"] == "main"]
    assert len(sampled) == turns, [t["chain_kind"] for t in rollout.turns]
    segments = rollout.segments(reward)
    assert sum(sum(s.loss_mask) for s in segments) == sum(len(t["output_ids"]) for t in sampled) > 0
    ids = [i for s in segments for i, m in zip(s.response_ids, s.loss_mask, strict=True) if m]
    assert ids == [i for t in sampled for i in t["output_ids"]]
    logprobs = [lp for s in segments for lp, m in zip(s.rollout_logprobs, s.loss_mask, strict=True) if m]
    assert logprobs == [lp for t in sampled for lp in t["output_logprobs"]]


async def test_claude_code_fixes_the_upstream_bug_in_its_image_and_a_partial_fix_scores_0(
    rig: Rig, upstream: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    diff, fixed, rollout = await run_in_image(rig, upstream, CLAUDE, "claude_code", tmp_path)
    assert (fixed.reward, fixed.failure_kind) == (1.0, None), fixed
    assert NEW_RE.encode() in diff["patch"] and b'.replace("-", "_" * n)' in diff["patch"]
    assert_every_sampled_token_at_mask_1(rollout, fixed.reward, turns=len(FIX) + 2)

    diff, partial, rollout = await run_in_image(rig, upstream, CLAUDE_PARTIAL, "claude_code", tmp_path)
    assert NEW_RE.encode() in diff["patch"] and b'"-", "_"' not in diff["patch"]
    assert (partial.reward, partial.failure_kind) == (0.0, "tests_failed"), partial
    assert_every_sampled_token_at_mask_1(rollout, partial.reward, turns=3)


async def test_codex_fixes_the_upstream_bug_in_its_image(
    rig: Rig, upstream: tuple[dict[str, Any], str], tmp_path: Path
) -> None:
    diff, fixed, rollout = await run_in_image(rig, upstream, CODEX, "codex", tmp_path)
    failing = [(t.name, t.status) for t in fixed.tests if t.status != "PASSED"]
    assert (fixed.reward, fixed.failure_kind) == (1.0, None), (failing, fixed.flags, diff["patch"])
    assert NEW_RE.encode() in diff["patch"]
    assert_every_sampled_token_at_mask_1(rollout, fixed.reward, turns=3)
