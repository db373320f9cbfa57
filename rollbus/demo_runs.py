"""Which run a stack is: a demo is a run of its own unless asked to continue one, and ``rollbus up`` on a
state dir that already holds a run continues it; both say which in their first lines.

A run is a topic namespace plus what the services keep for it under the stack's state dir (the trainer's
checkpoints and the segmenter's tables live under ``<dir>/<namespace or default>``), so a new namespace is a
new run on the same broker, and an old namespace is that run continued. Plain functions over paths.
"""

from __future__ import annotations

import re
import secrets
from datetime import UTC, datetime
from pathlib import Path

RUNS_FILE = "demo-runs"  # one namespace per line, the newest last
_CHECKPOINT = re.compile(r"^v(\d+)$")


class NoEarlierRun(ValueError):
    """``--resume`` with no demo run recorded in the state dir."""


def new_demo_namespace(now: datetime | None = None) -> str:
    """``demo-20261126-103512-1f2e``: sortable by start time, unique among demos started the same second."""
    moment = now or datetime.now(UTC)
    return f"demo-{moment:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def record_demo(state: Path, namespace: str) -> None:
    state.mkdir(parents=True, exist_ok=True)
    with (state / RUNS_FILE).open("a", encoding="utf-8") as runs:
        runs.write(namespace + "\n")


def last_demo(state: Path) -> str:
    """The namespace of the newest demo run recorded in ``state``."""
    try:
        names = [line.strip() for line in (state / RUNS_FILE).read_text(encoding="utf-8").splitlines()]
    except FileNotFoundError:
        names = []
    names = [name for name in names if name]
    if not names:
        raise NoEarlierRun(f"--resume: no earlier demo run recorded in {state / RUNS_FILE}")
    return names[-1]


def checkpoint_version(state: Path, namespace: str) -> int | None:
    """The trainer's newest checkpoint version for ``namespace`` under ``state``, or None if it has none."""
    root = state / "trainer" / (namespace or "default")
    if not root.is_dir():
        return None
    found = [int(m.group(1)) for p in root.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return max(found, default=None)


def run_line(namespace: str, created: int, total: int, version: int | None) -> str:
    """What a stack says once its topics are there: a new run, or which earlier run it continues."""
    topics = f"{namespace}.*" if namespace else "the un-namespaced topics"
    if created == total and version is None:
        return f"new run: {topics} created"
    kept = f"{total - created} of {total} topics already there, events kept"
    policy = f"trainer checkpoint v{version}" if version is not None else "no trainer checkpoint yet"
    return f"continuing the run in {topics}: {kept}; {policy}"
