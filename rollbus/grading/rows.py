"""A dataset row's grader, read once into plain data: swepro, eval_cmd or f2p_script (exactly one).

Rows come in slime's shape (``metadata`` with ``swepro`` / ``eval_cmd`` / ``remote_env_info.f2p_script``, each
also accepted under ``remote_env_info``) and in SWE-bench Pro's (``selected_test_files_to_run`` and test lists
as strings holding Python list literals). rollbus adds ``eval_files`` (workdir-relative destination -> host
path of an eval-only file, copied in after the patch). Host paths that are relative resolve against the
dataset file's directory (``base_dir``). A row that cannot be graded raises :class:`BadRow`.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from rollbus.task_image import ImageFieldError, image_kind, parse_image, parse_user, parse_workdir


class BadRow(ValueError):
    """The row's grading fields are missing, contradictory or malformed; the message says which."""


@dataclass(frozen=True)
class Swepro:
    run_script: Path
    parser_script: Path
    selected_test_files: tuple[str, ...]
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    restore_cmd: str  # the last line of before_repo_set_cmd: ``git checkout <ref> -- <paths>``
    restore_ref: str  # the later commit the target tests come from (it never enters a sandbox)
    restore_paths: tuple[str, ...]  # what is taken out of it on the host and copied in after the patch

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*self.fail_to_pass, *self.pass_to_pass]))


@dataclass(frozen=True)
class EvalCmd:
    cmd: str


@dataclass(frozen=True)
class F2PScript:
    script: str


@dataclass(frozen=True)
class Harbor:
    """A Harbor task's verifier: ``tests/`` copied in after the agent, ``bash /tests/test.sh``, the reward
    from ``/logs/verifier/reward.txt`` or ``reward.json`` (:mod:`rollbus.task_formats.harbor`). It needs the
    task's container image: only a container backend grades it."""

    task_dir: Path
    settings: Mapping[str, Any]


HARBOR_SOLUTION = "\0harbor-solution\0"  # the "patch" that tells a container backend to run solve.sh
Grader = Swepro | EvalCmd | F2PScript | Harbor
GRADER_KEYS = ("swepro", "eval_cmd", "f2p_script", "harbor")


@dataclass(frozen=True)
class GradingSpec:
    """Everything the grader needs from a row."""

    instance_id: str
    image: Path  # a host path image (the bwrap backend); for a container image, its reference as a Path
    workdir: str
    grader: Grader
    eval_files: Mapping[str, Path] = field(default_factory=dict)
    pre_commands: tuple[str, ...] = ()
    container_image: str | None = None  # the row's container image reference (a container backend's)
    user: str | None = None  # the OS user the agent runs as (metadata.user), for a container backend
    image_digest: str | None = None  # the digest the agent's container ran (from the diff): a regrade's pin
    test_patch: str | None = None  # SWE-bench's: applied over the row's test files after the agent's patch
    timeout_s: float | None = None  # the row's own deadline (a Harbor verifier's), under the grader's
    resources: Mapping[str, Any] | None = None  # what the row asks (cpus, memory_mb, storage_mb): a container
    # backend narrows its grading limits to it, never past the operator's (rollbus.task_image.row_limits)

    def test_patch_files(self) -> tuple[str, ...]:
        return patch_paths(self.test_patch) if self.test_patch else ()

    def test_files(self) -> set[str]:
        """The row's test files: a patch touching any of them is flagged."""
        files = set(self.eval_files) | set(self.test_patch_files())
        grader = self.grader
        if isinstance(grader, Swepro):
            files.update(f.split(" | ")[0] for f in grader.selected_test_files)
            files.update(t.split("::")[0] for t in grader.required)
            files.update(grader.restore_paths)
        elif isinstance(grader, Harbor):
            pass  # its tests live outside the repository (/tests)
        else:
            text = grader.cmd if isinstance(grader, EvalCmd) else grader.script
            files.update(m.lstrip("./") for m in re.findall(r"[\w./-]+\.py\b", text))
        return {str(PurePosixPath(f)) for f in files if f}


def parse_row(row: Mapping[str, Any], base_dir: Path) -> GradingSpec:
    """The :class:`GradingSpec` of a full row (``metadata`` may be a JSON string, as on the bus)."""
    metadata = row.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError as exc:
            raise BadRow(f"metadata is not JSON: {exc}") from None
    if not isinstance(metadata, Mapping):
        raise BadRow("row has no metadata object")
    return parse_metadata(metadata, base_dir)


def parse_metadata(metadata: Mapping[str, Any], base_dir: Path) -> GradingSpec:
    env = metadata.get("remote_env_info") or {}
    if not isinstance(env, Mapping):
        raise BadRow("remote_env_info is not an object")

    def get(key: str) -> Any:
        value = metadata.get(key)
        return env.get(key) if value in (None, "") else value

    if get("image") in (None, ""):
        raise BadRow("metadata has no image")
    try:
        image = parse_image(get("image"))
        workdir = parse_workdir(get("workdir"))
        user = parse_user(get("user"))
    except ImageFieldError as exc:
        raise BadRow(str(exc)) from None
    found = [key for key in GRADER_KEYS if get(key) not in (None, "", {})]
    if not found:
        raise BadRow("no grader (swepro, eval_cmd, remote_env_info.f2p_script or harbor)")
    if len(found) > 1:
        raise BadRow(f"more than one grader: {', '.join(found)}")
    return GradingSpec(
        instance_id=str(get("instance_id") or ""),
        image=resolve(base_dir, image.text) if image.kind == "path" else Path(image.text),
        workdir=workdir,
        grader=parse_grader(found[0], get(found[0]), base_dir),
        eval_files=parse_eval_files(get("eval_files"), base_dir),
        pre_commands=tuple(string_list(get("pre_commands"), "pre_commands")),
        container_image=image.text if image.kind == "container" else None,
        user=user,
        test_patch=parse_test_patch(get("test_patch")),
        timeout_s=positive(get("grade_timeout_sec"), "grade_timeout_sec"),
        resources=resources if isinstance(resources := get("resources"), Mapping) else None,
    )


def positive(value: Any, where: str) -> float | None:
    """A row's optional positive number of seconds."""
    if value in (None, ""):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise BadRow(f"{where} must be a positive number of seconds, got {value!r}")
    return float(value)


def parse_test_patch(value: Any) -> str | None:
    """SWE-bench's ``test_patch``: a unified diff whose paths stay inside the repository."""
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise BadRow("test_patch must be a string (a unified diff)")
    if not patch_paths(value):
        raise BadRow("test_patch names no file (not a unified diff?)")
    return value


DIFF_PATH = re.compile(r"^(?:diff --git a/(\S+) b/(\S+)|--- a/(\S+)|\+\+\+ b/(\S+))", re.MULTILINE)


def patch_paths(patch: str) -> tuple[str, ...]:
    """Every repository path a unified diff touches (old and new names), checked to stay inside."""
    found: dict[str, None] = {}
    for match in DIFF_PATH.finditer(patch):
        for path in filter(None, match.groups()):
            pure = PurePosixPath(path)
            if pure.is_absolute() or ".." in pure.parts:
                raise BadRow(f"test_patch touches a path outside the repository: {path!r}")
            found[str(pure)] = None
    return tuple(found)


def parse_grader(kind: str, value: Any, base_dir: Path) -> Grader:
    if kind == "eval_cmd":
        if not isinstance(value, str):
            raise BadRow("eval_cmd must be a string")
        return EvalCmd(value)
    if kind == "f2p_script":
        if not isinstance(value, str):
            raise BadRow("f2p_script must be a string")
        return F2PScript(value)
    if kind == "harbor":
        if not isinstance(value, Mapping) or not isinstance(value.get("task_dir"), str):
            raise BadRow("harbor must be an object naming its task_dir")
        return Harbor(resolve(base_dir, value["task_dir"]), dict(value))
    if not isinstance(value, Mapping):
        raise BadRow("swepro must be an object")
    return parse_swepro(value, base_dir)


def parse_swepro(value: Mapping[str, Any], base_dir: Path) -> Swepro:
    for key in ("run_script_path", "parser_script_path", "before_repo_set_cmd"):
        if not isinstance(value.get(key), str) or not value[key].strip():
            raise BadRow(f"swepro.{key} is missing")
    selected = value.get("selected_test_files")
    if selected in (None, "", []):
        selected = value.get("selected_test_files_to_run")
    lines = [line for line in value["before_repo_set_cmd"].strip().splitlines() if line.strip()]
    ref, paths = parse_restore(lines[-1])
    return Swepro(
        run_script=resolve(base_dir, value["run_script_path"]),
        parser_script=resolve(base_dir, value["parser_script_path"]),
        selected_test_files=tuple(string_list(selected, "swepro.selected_test_files")),
        fail_to_pass=tuple(string_list(value.get("fail_to_pass"), "swepro.fail_to_pass")),
        pass_to_pass=tuple(string_list(value.get("pass_to_pass"), "swepro.pass_to_pass")),
        restore_cmd=lines[-1],
        restore_ref=ref,
        restore_paths=paths,
    )


def parse_restore(line: str) -> tuple[str, tuple[str, ...]]:
    """``git checkout <ref> -- <paths>`` (SWE-bench Pro's last line of ``before_repo_set_cmd``) as its ref
    and paths. The grader takes those files out of the image's git on the host, so the line is read, never
    run; any other form is a bad row."""
    try:
        argv = shlex.split(line)
    except ValueError:
        argv = []
    if len(argv) < 5 or argv[:2] != ["git", "checkout"] or argv[3] != "--" or argv[2].startswith("-"):
        expected = "`git checkout <ref> -- <paths>`"
        raise BadRow(f"the last line of swepro.before_repo_set_cmd is not {expected}: {line!r}")
    paths = tuple(str(PurePosixPath(p)) for p in argv[4:])
    for path in paths:
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts or path in ("", "."):
            raise BadRow(f"swepro.before_repo_set_cmd checks out a path outside the repository: {path!r}")
    return argv[2], paths


def string_list(value: Any, where: str) -> list[str]:
    """A list of strings, given as a list or as a string holding a Python/JSON list literal."""
    if value in (None, ""):
        return []
    if isinstance(value, str):
        value = list_literal(value, where)
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise BadRow(f"{where} must be a list of strings")
    return list(value)


def list_literal(text: str, where: str) -> Any:
    """A JSON array or a Python list literal (SWE-bench Pro writes the latter)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise BadRow(f"{where} is a string but not a list literal: {text[:80]!r}") from None


def parse_eval_files(value: Any, base_dir: Path) -> dict[str, Path]:
    if value in (None, "", {}):
        return {}
    if not isinstance(value, Mapping):
        raise BadRow("eval_files must map workdir-relative destinations to host paths")
    out = {}
    for dest, src in value.items():
        pure = PurePosixPath(str(dest))
        if pure.is_absolute() or ".." in pure.parts or not isinstance(src, str):
            raise BadRow(f"eval_files entry {dest!r} must be a relative destination inside the workdir")
        out[str(pure)] = resolve(base_dir, src)
    return out


def resolve(base_dir: Path, path: str) -> Path:
    return (Path(base_dir) / path).resolve()


PATH_KEYS = ("image",)
SWEPRO_PATH_KEYS = ("run_script_path", "parser_script_path")


def absolute_paths(metadata: Mapping[str, Any], base_dir: Path) -> dict[str, Any]:
    """``metadata`` with every host path made absolute against ``base_dir`` (what ``rollbus submit`` does
    before a row leaves the dataset file's directory): image, swepro scripts, eval_files sources."""
    out = json.loads(json.dumps(metadata))
    for holder in (out, out.get("remote_env_info") or {}):
        image = holder.get("image")
        if isinstance(image, str) and image and image_kind(image) == "path":
            holder["image"] = str(resolve(base_dir, image))
        swepro = holder.get("swepro")
        if isinstance(swepro, dict):
            for key in SWEPRO_PATH_KEYS:
                if isinstance(swepro.get(key), str):
                    swepro[key] = str(resolve(base_dir, swepro[key]))
        files = holder.get("eval_files")
        if isinstance(files, dict):
            holder["eval_files"] = {
                k: str(resolve(base_dir, v)) if isinstance(v, str) else v for k, v in files.items()
            }
    return out
