"""Settings shared by every component: flags with ``ROLLBUS_*`` environment fallbacks.

Each service declares its options with :func:`add_option`, so ``--help`` documents the flag, its
environment variable and its default in one place, and a bad value fails at start-up.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

DEFAULT_STATE_DIR = ".rollbus"
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def env_name(flag: str) -> str:
    """``--bootstrap-servers`` -> ``ROLLBUS_BOOTSTRAP_SERVERS``."""
    return "ROLLBUS_" + flag.lstrip("-").replace("-", "_").upper()


def add_option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    default: Any = None,
    type: Any = str,  # noqa: A002 - mirrors argparse
    help: str,  # noqa: A002
    **kwargs: Any,
) -> None:
    """Add ``flag`` whose default comes from its ``ROLLBUS_*`` variable, then ``default``."""
    env = env_name(flag)
    raw = os.environ.get(env)
    try:
        value = type(raw) if raw is not None else default
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{env}={raw!r} is not a valid value for {flag}: {exc}") from exc
    parser.add_argument(
        flag, default=value, type=type, help=f"{help} [env {env}; default {default!r}]", **kwargs
    )


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options every component understands: where the bus is and where local state lives."""
    add_option(
        parser,
        "--bootstrap-servers",
        default=DEFAULT_BOOTSTRAP,
        help="Kafka bootstrap servers (any Kafka-compatible cluster)",
    )
    add_option(parser, "--state-dir", default=DEFAULT_STATE_DIR, type=Path, help="local state directory")


def bootstrap_servers() -> str:
    return os.environ.get("ROLLBUS_BOOTSTRAP_SERVERS", DEFAULT_BOOTSTRAP)


def state_dir() -> Path:
    return Path(os.environ.get("ROLLBUS_STATE_DIR", DEFAULT_STATE_DIR))


def cache_dir() -> Path:
    """Artefacts kept outside the clone (venv, Kafka jars, Claude Code CLI, tokenizer files)."""
    return Path(os.environ.get("ROLLBUS_CACHE", Path.home() / ".cache" / "rollbus"))
