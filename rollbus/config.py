"""Settings shared by every component: flags with ``ROLLBUS_*`` environment fallbacks.

Each service declares its options with :func:`add_option`, so ``--help`` documents the flag, its
environment variable and its default in one place, and a bad value fails at start-up.

A service's own flags read variables scoped by its name (``rollbus engine --port`` <-
``ROLLBUS_ENGINE_PORT``), so one environment can configure every service without them reading each other's
ports; the flags every component shares (``--bootstrap-servers``, ``--state-dir``) read unscoped ones
(``ROLLBUS_BOOTSTRAP_SERVERS``).
The scope comes from the parser's ``prog`` (``rollbus <service>``), which :mod:`rollbus.cli` sets.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

DEFAULT_STATE_DIR = ".rollbus"
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


def env_name(flag: str, scope: str | None = None) -> str:
    """``--bootstrap-servers`` -> ``ROLLBUS_BOOTSTRAP_SERVERS``; with scope ``engine``, ``--port`` ->
    ``ROLLBUS_ENGINE_PORT``."""
    parts = [scope, flag.lstrip("-")] if scope else [flag.lstrip("-")]
    return "ROLLBUS_" + "_".join(parts).replace("-", "_").upper()


def parser_scope(parser: argparse.ArgumentParser) -> str | None:
    """``rollbus sandbox-runner`` -> ``sandbox-runner``; other progs have no scope."""
    words = parser.prog.split()
    return words[1] if len(words) == 2 and words[0] == "rollbus" else None


def add_option(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    default: Any = None,
    type: Any = str,  # noqa: A002 - mirrors argparse
    help: str,  # noqa: A002
    shared: bool = False,
    **kwargs: Any,
) -> None:
    """Add ``flag`` whose default comes from its ``ROLLBUS_*`` variable, then ``default``.

    ``shared`` flags read the unscoped variable (see the module docstring)."""
    env = env_name(flag, None if shared else parser_scope(parser))
    raw = os.environ.get(env)
    try:
        value = type(raw) if raw is not None else default
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        from rollbus.settings import SettingsError  # late: rollbus.settings imports this module

        raise SettingsError(f"{env}={raw!r}: not a valid value for {flag} ({exc})") from None
    parser.add_argument(
        flag, default=value, type=type, help=f"{help} [env {env}; default {as_typed(default)}]", **kwargs
    )


def as_typed(default: Any) -> str:
    """A default as a person would type it: ``.rollbus`` for a path, ``unset`` for None, ``''`` for
    the empty string; ``%`` escaped for argparse."""
    if default is None:
        return "unset"
    if isinstance(default, str) and not default:
        return "''"
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(default).replace("%", "%%")


def parse_bool(raw: str | bool) -> bool:
    """A boolean flag or variable: 1/true/yes/on, 0/false/no/off (or empty)."""
    if isinstance(raw, bool):
        return raw
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {raw!r}")


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """Options every component understands: where the bus is and where local state lives."""
    add_option(
        parser,
        "--bootstrap-servers",
        default=None,
        help="Kafka bootstrap servers (any Kafka-compatible cluster); unset: the embedded broker of "
        f"--state-dir wherever `rollbus broker start` put it, else {DEFAULT_BOOTSTRAP}",
        shared=True,
    )
    add_option(
        parser, "--state-dir", default=DEFAULT_STATE_DIR, type=Path, help="local state directory", shared=True
    )


def broker_record_path(state_dir: Path | str) -> Path:
    """Where ``rollbus broker start`` records the embedded broker's pid and port (:mod:`rollbus.broker`)."""
    return Path(state_dir) / "kafka" / "broker.json"


def recorded_bootstrap(state_dir: Path | str) -> str | None:
    """``127.0.0.1:<port>`` of the embedded broker last started from ``state_dir``, or None if none was."""
    try:
        port = int(json.loads(broker_record_path(state_dir).read_text())["port"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"127.0.0.1:{port}"


def default_bootstrap(state_dir: Path | str | None = None) -> str:
    """Where the bus is when no flag says: ``ROLLBUS_BOOTSTRAP_SERVERS``, else the embedded broker of the
    state dir wherever ``rollbus broker start`` put it, else ``127.0.0.1:9092``."""
    if os.environ.get("ROLLBUS_BOOTSTRAP_SERVERS"):
        return os.environ["ROLLBUS_BOOTSTRAP_SERVERS"]
    where = state_dir if state_dir is not None else state_dir_default()
    return recorded_bootstrap(where) or DEFAULT_BOOTSTRAP


def state_dir_default() -> Path:
    return Path(os.environ.get("ROLLBUS_STATE_DIR") or DEFAULT_STATE_DIR)


def bootstrap_servers() -> str:
    return default_bootstrap()


def state_dir() -> Path:
    return Path(os.environ.get("ROLLBUS_STATE_DIR", DEFAULT_STATE_DIR))


def cache_dir() -> Path:
    """Artefacts kept outside the clone (venv, Kafka jars, Claude Code CLI, tokenizer files)."""
    return Path(os.environ.get("ROLLBUS_CACHE", Path.home() / ".cache" / "rollbus"))
