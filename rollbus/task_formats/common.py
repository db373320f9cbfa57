"""What every format reader shares: its error, the row hash, and the provenance kept on each task."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any


class FormatError(ValueError):
    """A source row or task directory that cannot become a rollbus row; the message names the field."""


def row_hash(source: Any) -> str:
    """A stable digest of the source row as given (canonical JSON): what ``rollbus validate`` keys its
    results by, and what says two tasks are the same."""
    text = json.dumps(source, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def provenance(fmt: str, digest: str, revision: str | None) -> dict[str, Any]:
    """``metadata.source``: the format the row came in, the dataset revision (if given) and its row hash."""
    return {"format": fmt, "revision": revision, "row_hash": digest}


def text_field(row: Mapping[str, Any], key: str, fmt: str, *, required: bool = True) -> str:
    value = row.get(key)
    if value in (None, "") and not required:
        return ""
    if not isinstance(value, str) or (required and not value.strip()):
        raise FormatError(f"{fmt}: {key} must be a non-empty string")
    return value


def slime_row(prompt: str, label: str | None, metadata: dict[str, Any]) -> dict[str, Any]:
    """The row rollbus grades (slime's ``{"prompt", "label", "metadata"}``)."""
    return {"prompt": prompt, "label": label, "metadata": metadata}
