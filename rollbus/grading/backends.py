"""The grader's sandbox backends, by name: each a module providing ``async grade(spec, patch, config) ->
GradeResult`` (:func:`rollbus.grading.run.grade`'s contract), imported only when chosen.

``local`` grades in bwrap sandboxes over host repository images; ``docker`` is the container backend's
(``rollbus.grading.container``), which grades in a fresh container from the row's image (pinned to the diff's
``image_digest``) and reports the digest it used as ``details["image_digest"]``. A backend whose module is not
in this build is named, never guessed.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Any

GRADE_BACKENDS: dict[str, str] = {
    "local": "rollbus.grading.run:grade",
    "docker": "rollbus.grading.container:grade",
}
Grade = Callable[..., Awaitable[Any]]


class BackendUnavailable(ValueError):
    """The named backend is unknown, or its module is not in this build."""


def grade_function(name: str) -> Grade:
    """The ``grade`` of backend ``name``."""
    target = GRADE_BACKENDS.get(name)
    if target is None:
        raise BackendUnavailable(f"unknown grading backend {name!r} (one of {', '.join(GRADE_BACKENDS)})")
    module, _, function = target.partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise BackendUnavailable(f"grading backend {name!r} is not available in this build ({exc})") from None
