"""The task formats users bring, read into the rows rollbus grades (slime's ``{prompt, label, metadata}``).

One module per format, each a pure reader over plain data: :mod:`.swebench` (SWE-bench, SWE-Gym and their
kin), :mod:`.swepro` (SWE-bench Pro as published), :mod:`.harbor` (Harbor task directories). Every row keeps
``metadata.source``: the format it came in, the dataset revision (if given) and its row hash.
:func:`load_dataset` is the I/O edge ``rollbus submit`` and ``rollbus validate`` share: a JSONL file of any
of them (rollbus's own rows included), a Harbor task folder, or a folder of tasks (task folders and JSONL
files: one dataset of several formats).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollbus.task_formats import harbor, swebench, swepro
from rollbus.task_formats.common import FormatError, provenance, row_hash

__all__ = [
    "FORMATS",
    "FormatError",
    "Loaded",
    "convert_row",
    "detect_row",
    "harbor",
    "load_dataset",
    "swebench",
    "swepro",
]

ROLLBUS = "rollbus"
FORMATS = (ROLLBUS, swebench.FORMAT, swepro.FORMAT, harbor.FORMAT)


@dataclass(frozen=True)
class Loaded:
    """One task of a dataset: ``row`` as JSON text (what ``rollbus.rows.parse_row`` reads) or ``error``;
    ``where`` says which line or folder."""

    where: str
    line: int
    text: str | None = None
    error: str | None = None


def detect_row(row: Mapping[str, Any], own_keys: tuple[str, ...] = ("prompt", "metadata")) -> str:
    """The format of one JSON row, or :class:`FormatError` listing what was looked for (``own_keys``: the
    prompt and metadata keys of rollbus's own rows)."""
    if any(key in row for key in own_keys):
        return ROLLBUS
    if swepro.looks_like(row):
        return swepro.FORMAT
    if swebench.looks_like(row):
        return swebench.FORMAT
    keys = ", ".join(sorted(row)[:12]) or "none"
    raise FormatError(
        "unknown row shape (rollbus rows have prompt/metadata; SWE-bench rows instance_id, base_commit, "
        f"test_patch, FAIL_TO_PASS; SWE-bench Pro rows dockerhub_tag, before_repo_set_cmd): keys {keys}"
    )


def convert_row(
    row: Mapping[str, Any], fmt: str, revision: str | None = None, metadata_key: str = "metadata"
) -> dict[str, Any]:
    """``row`` (of format ``fmt``) as a rollbus row; rollbus rows gain ``metadata.source`` if they lack it."""
    if fmt == swebench.FORMAT:
        return swebench.read_row(row, revision)
    if fmt == swepro.FORMAT:
        return swepro.read_row(row, revision)
    if fmt == ROLLBUS:
        out = dict(row)
        metadata = out.get(metadata_key)
        if isinstance(metadata, dict) and "source" not in metadata:
            out[metadata_key] = {**metadata, "source": provenance(ROLLBUS, row_hash(row), revision)}
        return out
    raise FormatError(f"format {fmt!r} is not a row format (one of {', '.join(FORMATS[:3])})")


def load_dataset(
    path: Path,
    fmt: str | None = None,
    revision: str | None = None,
    own_keys: tuple[str, str] = ("prompt", "metadata"),
) -> list[Loaded]:
    """Every task of ``path``: a JSONL file, a Harbor task folder, or a folder of tasks (Harbor task folders
    and JSONL files; ``own_keys``: the prompt and metadata keys of rollbus's own rows)."""
    if fmt is not None and fmt not in FORMATS:
        raise FormatError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if path.is_dir():
        return load_folder(path, fmt, revision, own_keys)
    if fmt == harbor.FORMAT:
        raise FormatError(f"{path} is a file: a Harbor dataset is a task folder or a folder of them")
    return load_jsonl(path, fmt, revision, own_keys)


def load_folder(path: Path, fmt: str | None, revision: str | None, own_keys: tuple[str, str]) -> list[Loaded]:
    """A Harbor task folder; or a folder of tasks: its Harbor task folders, then the rows of its ``*.jsonl``
    files (one dataset of several formats; ``fmt``, when given, picks the one kind read)."""
    names = {p.name for p in path.iterdir()}
    if harbor.is_task_dir(names):
        if fmt not in (None, harbor.FORMAT):
            raise FormatError(f"{path} is a Harbor task folder, not {fmt} rows")
        return load_harbor(path, revision)
    files = sorted(p for p in path.glob("*.jsonl") if p.is_file()) if fmt != harbor.FORMAT else []
    folders = [] if fmt not in (None, harbor.FORMAT) else task_folders(path)
    if fmt not in (None, harbor.FORMAT) and not files:
        raise FormatError(f"{path} is a folder without *.jsonl files: its {fmt} rows would come in those")
    if not files and not folders:
        raise FormatError(
            f"{path} holds no Harbor task (a folder with task.toml and instruction.md) and no *.jsonl file"
        )
    out = load_harbor(path, revision) if folders else []
    for file in files:
        out += load_jsonl(file, fmt, revision, own_keys)
    # numbered through the whole folder: a row without an instance id is named by its number (row<N>)
    return [dataclasses.replace(loaded, line=number) for number, loaded in enumerate(out, start=1)]


def task_folders(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and (p / "task.toml").is_file())


def load_jsonl(path: Path, fmt: str | None, revision: str | None, own_keys: tuple[str, str]) -> list[Loaded]:
    """Every row of a JSONL file, converted from its format (``fmt``, else detected per row)."""
    out = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(text)
                if not isinstance(row, dict):
                    raise FormatError(f"a row is a JSON object, not {type(row).__name__}")
                converted = convert_row(row, fmt or detect_row(row, own_keys), revision, own_keys[1])
            except (json.JSONDecodeError, FormatError) as exc:
                message = f"invalid JSON: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else str(exc)
                out.append(Loaded(where, number, error=message))
                continue
            out.append(Loaded(where, number, text=json.dumps(converted)))
    return out


def load_harbor(path: Path, revision: str | None = None) -> list[Loaded]:
    """A Harbor task folder, or a folder of them (``dataset.toml`` beside them is the dataset's own)."""
    if harbor.is_task_dir({p.name for p in path.iterdir()}):
        folders = [path]
    else:
        folders = task_folders(path)
        if not folders:
            raise FormatError(f"{path} holds no Harbor task (a folder with task.toml and instruction.md)")
    out = []
    for number, folder in enumerate(folders, start=1):
        try:
            out.append(Loaded(str(folder), number, text=json.dumps(harbor.load_task(folder, revision))))
        except (FormatError, OSError) as exc:
            out.append(Loaded(str(folder), number, error=str(exc)))
    return out
