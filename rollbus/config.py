"""Where rollbus keeps things outside the settings classes: the cache shared by clones, and the record the
embedded broker leaves in a state dir so clients find it on whatever port it took.

Options live in :mod:`rollbus.settings`; this module imports nothing of rollbus, so anything may import it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def broker_record_path(state_dir: Path | str) -> Path:
    """Where ``rollbus broker start`` records the embedded broker's pid and port
    (:mod:`rollbus.kafka.broker`)."""
    return Path(state_dir) / "kafka" / "broker.json"


def recorded_bootstrap(state_dir: Path | str) -> str | None:
    """``127.0.0.1:<port>`` of the embedded broker last started from ``state_dir``, or None if none was."""
    try:
        port = int(json.loads(broker_record_path(state_dir).read_text())["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"127.0.0.1:{port}"


def cache_dir() -> Path:
    """Artefacts kept outside the clone (venv, Kafka jars, Claude Code CLI, tokenizer files)."""
    return Path(os.environ.get("ROLLBUS_CACHE", Path.home() / ".cache" / "rollbus"))
