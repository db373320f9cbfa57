"""What makes two events one fact: each event type declares it once (:class:`Identity`), and every reader
that deduplicates (the segmenter, the trainer, the viewer, the fault test's judge) asks here.

Two events with equal :meth:`Identity.key` describe one fact. If their :func:`content_digest` is equal too,
the second is a writer's retry (a duplicate: dropped); otherwise they disagree about the fact (a conflict).
Incidental fields are left out of the content: when or how verbosely a writer wrote the fact, which a retry
may change (a reward graded again after a grader crash has a new ``at`` and new durations in ``details``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

# what a second event with a rule is to the first: another fact, a retry of it, or a disagreement about it
IdentityMatch = Literal["new", "duplicate", "conflict"]


@dataclass(frozen=True)
class Identity:
    """How to tell a retry of one fact from a second fact."""

    key: tuple[str, ...]  # the fields that name the fact
    incidental: tuple[str, ...] = ("schema_version",)  # fields a retry of the fact may change
    # (field, member): a member of an incidental JSON-object field that is content after all
    kept: tuple[tuple[str, str], ...] = ()


def json_member(text: Any, member: str) -> Any:
    """``json.loads(text)[member]``, None when ``text`` is not a JSON object or lacks it."""
    try:
        value = json.loads(text or "{}")
    except (TypeError, ValueError):
        return None
    return value.get(member) if isinstance(value, dict) else None


def content(rule: Identity, record: Mapping[str, Any]) -> dict[str, Any]:
    """What ``record`` says of its fact: every field but the incidental ones, plus the kept members."""
    kept = {name: value for name, value in record.items() if name not in rule.incidental}
    kept.update({member: json_member(record.get(field), member) for field, member in rule.kept})
    return kept


def content_digest(rule: Identity, record: Mapping[str, Any]) -> str:
    """A stable digest of :func:`content` (24 hex digits): it is kept in the segmenter's changelog, so it
    must not change across processes or releases."""
    text = json.dumps(content(rule, record), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def judge(rule: Identity, first: Mapping[str, Any], second: Mapping[str, Any]) -> IdentityMatch:
    """``second`` against ``first``: another fact (new), a retry of it (duplicate), or a disagreement."""
    if tuple(first.get(k) for k in rule.key) != tuple(second.get(k) for k in rule.key):
        return "new"
    return "duplicate" if content_digest(rule, first) == content_digest(rule, second) else "conflict"
