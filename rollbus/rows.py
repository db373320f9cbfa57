"""Dataset rows (slime's JSONL: ``{"prompt", "label", "metadata"}``) checked and turned into `tasks` records.

A row must name an image (a host path or a container image reference, :mod:`rollbus.task_image`), a
workdir (optionally the user the agent runs as), a prompt (the prompt key, else
``metadata.problem_statement``) and at most one grader (swepro, ``eval_cmd`` or
``remote_env_info.f2p_script``, checked as the grader reads it; none is allowed and scores 0).
A bad row is reported with its line number and skipped; the rest are submitted.
Host paths in the metadata (image, swepro scripts, eval files) are made absolute against the dataset file, so
tasks run from any directory.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbus.grading.rows import BadRow, absolute_paths, parse_metadata
from rollbus.task_image import ImageFieldError, parse_image, parse_user, parse_workdir


class RowError(ValueError):
    """Why one row cannot become a task (the message is one line)."""


@dataclass(frozen=True)
class RowKeys:
    input_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str = "metadata"


@dataclass(frozen=True)
class Row:
    line: int
    prompt: str
    label: str | None
    metadata: dict[str, Any]

    @property
    def instance_id(self) -> str:
        raw = self.metadata.get("instance_id")
        return str(raw) if raw not in (None, "") else f"row{self.line}"


def graders_of(metadata: dict[str, Any]) -> list[str]:
    """Which graders the metadata names (swepro, eval_cmd, f2p_script, harbor; also under
    ``remote_env_info``)."""
    env = info if isinstance(info := metadata.get("remote_env_info"), dict) else {}
    found = []
    for key in ("swepro", "eval_cmd", "f2p_script", "harbor"):
        value = metadata.get(key)
        if (value if value not in (None, "") else env.get(key)) not in (None, "", {}):
            found.append(key)
    return found


def parse_row(text: str, line: int, keys: RowKeys, base: Path) -> Row:
    """One JSONL line as a :class:`Row`, or :class:`RowError` saying what is wrong with it."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RowError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise RowError(f"a row is a JSON object, not {type(data).__name__}")
    metadata = data.get(keys.metadata_key, {})
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            raise RowError(f"{keys.metadata_key!r} is a string that is not JSON") from None
    if not isinstance(metadata, dict):
        raise RowError(f"{keys.metadata_key!r} must be a JSON object")
    metadata = absolute_paths(metadata, base)
    env = info if isinstance(info := metadata.get("remote_env_info"), dict) else {}
    if not (metadata.get("image") or env.get("image")):
        raise RowError(
            f"no image in {keys.metadata_key!r} (a repository directory or tarball, or a container image)"
        )
    workdir = metadata.get("workdir") or env.get("workdir")
    if not isinstance(workdir, str) or not workdir.startswith("/"):
        raise RowError(f"no workdir in {keys.metadata_key!r} (the repository's absolute path inside)")
    try:
        parse_image(metadata.get("image") or env.get("image"), f"{keys.metadata_key}.image")
        parse_workdir(workdir, f"{keys.metadata_key}.workdir")
        parse_user(metadata.get("user") or env.get("user"), f"{keys.metadata_key}.user")
    except ImageFieldError as exc:
        raise RowError(str(exc)) from None
    prompt = data.get(keys.input_key)
    if not isinstance(prompt, str) or not prompt.strip():
        prompt = metadata.get("problem_statement")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RowError(
            f"no prompt: neither {keys.input_key!r} nor metadata.problem_statement is a non-empty text"
        )
    graders = graders_of(metadata)
    if len(graders) > 1:
        raise RowError(f"{len(graders)} graders ({', '.join(graders)}): a row names at most one")
    if graders:  # its fields are checked now, not when its first diff is graded
        try:
            parse_metadata(metadata, base)
        except BadRow as exc:
            raise RowError(str(exc)) from None
    label = data.get(keys.label_key)
    if label is not None and not isinstance(label, str):
        label = json.dumps(label)
    return Row(line, prompt, label, metadata)


def read_rows(path: Path, keys: RowKeys) -> Iterator[Row | tuple[int, RowError]]:
    """Every non-blank line of ``path``: its :class:`Row`, or ``(line number, error)``."""
    base = path.resolve().parent
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                yield parse_row(text, number, keys, base)
            except RowError as exc:
                yield number, exc


def read_dataset(
    path: Path, keys: RowKeys, fmt: str | None = None, revision: str | None = None
) -> Iterator[Row | tuple[str, RowError]]:
    """Every task of ``path`` in any format users bring (:mod:`rollbus.task_formats`: a JSONL file of rollbus,
    SWE-bench or SWE-bench Pro rows, a Harbor task folder or a folder of them): its :class:`Row`, or
    ``(where, error)``. Raises ``FormatError`` when the dataset as a whole cannot be read that way."""
    from rollbus.task_formats import load_dataset

    base = path.resolve() if path.is_dir() else path.resolve().parent
    for loaded in load_dataset(path, fmt, revision, (keys.input_key, keys.metadata_key)):
        if loaded.text is None:
            yield loaded.where, RowError(loaded.error or "unreadable")
            continue
        try:
            yield parse_row(loaded.text, loaded.line, keys, base)
        except RowError as exc:
            yield loaded.where, exc


def slug(text: str, limit: int = 48) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:limit].strip("_") or "task"


def tasks_for(
    row: Row, samples: int, now_ms: int | None = None, group: str | None = None
) -> list[dict[str, Any]]:
    """``samples`` `tasks` records for ``row``, one group. Rollout ids start with the instance id; ``group``
    names the group after it (default: random), for a submitter that must submit the same group again."""
    group = group or uuid.uuid4().hex[:10]
    at = int(time.time() * 1000) if now_ms is None else now_ms
    metadata = json.dumps(row.metadata)
    return [
        {
            "rollout_id": f"{slug(row.instance_id)}-{group}-{i}",
            "group_id": f"{slug(row.instance_id)}-{group}",
            "sample_index": i,
            "group_size": samples,
            "prompt": row.prompt,
            "label": row.label,
            "metadata": metadata,
            "submitted_at": at,
            "env_config": None,
            "ctx_config": None,
            "messages": None,
        }
        for i in range(samples)
    ]
