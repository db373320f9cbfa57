"""Harbor task directories (Terminal-Bench 2.x; ``task.toml`` schema 1.x) -> rollbus rows.

:func:`read_task` is pure: it takes the directory's files as plain data (``files``: relative path -> bytes,
for the few it reads, and every path for the row hash) and returns the row, or raises :class:`FormatError`
naming the field it refuses. :func:`load_task` is the I/O edge. What becomes of each field:

- honoured: ``instruction.md`` (the prompt, verbatim); ``environment/Dockerfile`` (the image, built locally
  by a container backend; its last ``WORKDIR`` is the workdir, else ``/app``) or ``[environment]
  docker_image``; ``tests/`` (copied in for the verifier only, after the agent finished);
  ``solution/solve.sh`` (the gold, for ``rollbus validate``); reward from ``/logs/verifier/reward.txt``,
  else ``reward.json``;
  ``[agent] timeout_sec`` and ``[verifier] timeout_sec`` (each phase's deadline); ``[environment]
  build_timeout_sec``, ``cpus``, ``memory_mb`` (or 1.4's ``memory = "2G"``), ``storage_mb`` (or
  ``storage``); ``agent.user`` and ``[verifier] user``; ``[verifier] env`` and ``[solution] env``;
  ``network_mode`` (or ``allow_internet``) per phase: ``no-network`` as asked; ``public`` for the agent is
  narrowed to the adapter alone (the policy never reaches the internet); the environment's baseline
  ``public`` is recorded for the verifier, which runs without network all the same (its note says so when
  it fails). The verifier's ``[environment]`` resources narrow its container limits too.
- refused by name: ``[verifier] network_mode = "public"`` (the verifier runs the policy's code: with a
  network, that code could fetch an answer or send the tests out while its reward is decided; prepare the
  verifier's tools in ``environment/Dockerfile``), ``[verifier] user`` root (by name or uid 0: the same
  code would run as root), ``[environment] gpus`` > 0, ``mcp_servers``, ``network_mode = "allowlist"``,
  ``[[steps]]``
  (multi-step tasks), a separate verifier environment (``environment_mode = "separate"``,
  ``[verifier.environment]``), ``environment/docker-compose.yaml`` without a Dockerfile, schema versions
  other than 1.x.
- ignored (kept under ``metadata.harbor.ignored``): ``[metadata]``, ``[task]`` besides ``name``,
  ``artifacts``, and any key not named above.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollbus.task_formats.common import FormatError, provenance, slime_row

FORMAT = "harbor"
DEFAULT_WORKDIR = "/app"
DEFAULT_TIMEOUT_S = 600.0
READ = ("task.toml", "instruction.md", "environment/Dockerfile", "solution/solve.sh", "tests/test.sh")
NETWORK_MODES = ("public", "no-network", "allowlist")
REWARD_FILES = ("/logs/verifier/reward.txt", "/logs/verifier/reward.json")
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
KNOWN = {
    "": {"version", "schema_version", "task", "metadata", "verifier", "agent", "solution", "environment",
         "steps", "artifacts"},
    "verifier": {"timeout_sec", "env", "user", "network_mode", "allowed_hosts", "environment"},
    "agent": {"timeout_sec", "user", "network_mode", "allowed_hosts"},
    "solution": {"env"},
    "environment": {"build_timeout_sec", "docker_image", "cpus", "memory_mb", "memory", "storage_mb",
                    "storage", "gpus", "allow_internet", "network_mode", "allowed_hosts", "mcp_servers",
                    "environment_mode"},
}  # fmt: skip


def is_task_dir(names: set[str]) -> bool:
    return "task.toml" in names and "instruction.md" in names


def task_hash(files: Mapping[str, bytes]) -> str:
    """The row hash of a task directory: every file's path and content."""
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(f"{rel}\0{hashlib.sha256(files[rel]).hexdigest()}\n".encode())
    return "sha256:" + digest.hexdigest()


def read_task(
    name: str, files: Mapping[str, bytes], task_dir: str, revision: str | None = None
) -> dict[str, Any]:
    """The rollbus row of the Harbor task whose files are ``files`` (relative path -> bytes); ``task_dir`` is
    its host path (where the backend finds ``environment/``, ``tests/`` and ``solution/``)."""
    if "task.toml" not in files or "instruction.md" not in files:
        raise FormatError(f"{FORMAT}: {name}: a task directory holds task.toml and instruction.md")
    try:
        config = tomllib.loads(files["task.toml"].decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise FormatError(f"{FORMAT}: {name}: task.toml: {exc}") from None
    schema = str(config.get("schema_version") or config.get("version") or "1.0")
    if not re.fullmatch(r"1(\.\d+)*", schema):
        raise FormatError(f"{FORMAT}: {name}: task.toml schema {schema!r} (rollbus reads 1.x)")
    instruction = files["instruction.md"].decode("utf-8", errors="replace")
    if not instruction.strip():
        raise FormatError(f"{FORMAT}: {name}: instruction.md is empty")
    env, agent, verifier = (_table(config, k, name) for k in ("environment", "agent", "verifier"))
    solution = _table(config, "solution", name)
    _refuse(config, env, verifier, files, name)
    task_name = _table(config, "task", name).get("name") or name
    if not isinstance(task_name, str) or not task_name:
        raise FormatError(f"{FORMAT}: {name}: task.name must be a string")
    if "tests/test.sh" not in files:
        raise FormatError(f"{FORMAT}: {name}: no tests/test.sh (the verifier)")
    digest = task_hash(files)
    image = env.get("docker_image")
    if image is not None and (not isinstance(image, str) or not image):
        raise FormatError(f"{FORMAT}: {name}: environment.docker_image must be an image reference")
    if image is None and "environment/Dockerfile" not in files:
        raise FormatError(f"{FORMAT}: {name}: no environment/Dockerfile and no environment.docker_image")
    local_tag = f"rollbus-harbor/{_slug(task_name)}:{digest.removeprefix('sha256:')[:16]}"
    dockerfile = files.get("environment/Dockerfile", b"").decode("utf-8", errors="replace")
    network = {
        "agent": _network(agent, env, "agent", name),
        "verifier": _network(verifier, env, "verifier", name),
    }
    harbor = {
        "task_dir": task_dir,
        "schema_version": schema,
        "environment_dir": "environment",
        "build_image": None if image else local_tag,  # what a container backend builds environment/ as
        "tests_dir": "tests",
        "solution": "solution/solve.sh" if "solution/solve.sh" in files else None,
        "reward_files": list(REWARD_FILES),
        "build_timeout_sec": _number(env, "build_timeout_sec", DEFAULT_TIMEOUT_S, name),
        "verifier_timeout_sec": _number(verifier, "timeout_sec", DEFAULT_TIMEOUT_S, name),
        "verifier_user": _string(verifier, "user", name),
        "verifier_env": _env(verifier, "verifier", name),
        "solution_env": _env(solution, "solution", name),
        "network": network,
        "ignored": _ignored(config),
    }
    metadata: dict[str, Any] = {
        "instance_id": task_name,
        "image": f"docker://{image or local_tag}",
        "workdir": dockerfile_workdir(dockerfile) or DEFAULT_WORKDIR,
        "problem_statement": instruction,
        "agent_timeout_sec": _number(agent, "timeout_sec", DEFAULT_TIMEOUT_S, name),
        "grade_timeout_sec": harbor["verifier_timeout_sec"],
        "resources": {
            "cpus": _number(env, "cpus", 1, name),
            "memory_mb": _megabytes(env, "memory_mb", "memory", 2048, name),
            "storage_mb": _megabytes(env, "storage_mb", "storage", 10240, name),
        },
        "harbor": harbor,
        "source": provenance(FORMAT, digest, revision),
    }
    if (user := _string(agent, "user", name)) is not None:
        metadata["user"] = user
    return slime_row(instruction, None, metadata)


def dockerfile_workdir(text: str) -> str | None:
    """The last absolute ``WORKDIR`` of a Dockerfile (where the task's files are), or None."""
    found = None
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) == 2 and parts[0].upper() == "WORKDIR" and parts[1].strip().startswith("/"):
            found = parts[1].strip().strip("\"'")
    return found


def _refuse(config: dict, env: dict, verifier: dict, files: Mapping[str, bytes], name: str) -> None:
    def no(field: str, why: str) -> FormatError:
        return FormatError(f"{FORMAT}: {name}: {field} is not supported: {why}")

    if config.get("steps"):
        raise no("[[steps]]", "multi-step tasks")
    gpus = env.get("gpus", 0)
    if not isinstance(gpus, int) or gpus != 0:
        raise no("environment.gpus", f"{gpus!r} GPUs asked; sandboxes get none")
    if env.get("mcp_servers"):
        raise no("environment.mcp_servers", "MCP servers beside the task")
    if env.get("environment_mode", "shared") != "shared" or verifier.get("environment"):
        raise no("verifier.environment / environment_mode", "a separate verifier environment")
    if "environment/Dockerfile" not in files and "environment/docker-compose.yaml" in files:
        raise no("environment/docker-compose.yaml", "multi-container environments")
    if verifier.get("network_mode") == "public":
        raise no(
            "verifier.network_mode = 'public'",
            "the verifier runs the policy's code, which with a network could fetch an answer or send the"
            " tests out while its reward is decided; verifiers run without network (install their tools in"
            " environment/Dockerfile)",
        )
    user = str(verifier.get("user", ""))
    if user.partition(":")[0] in ("root", "0"):
        raise no(f"verifier.user = {user!r}", "the verifier runs the policy's code, never as root")


def _network(phase: dict, env: dict, which: str, name: str) -> str:
    """The phase's network: its own ``network_mode``, else the environment's, else ``allow_internet``."""
    mode = phase.get("network_mode") or env.get("network_mode")
    if mode is None:
        allow = env.get("allow_internet", True)
        if not isinstance(allow, bool):
            raise FormatError(f"{FORMAT}: {name}: environment.allow_internet must be true or false")
        mode = "public" if allow else "no-network"
    if mode not in NETWORK_MODES:
        known = ", ".join(NETWORK_MODES)
        raise FormatError(f"{FORMAT}: {name}: {which}.network_mode {mode!r} (one of {known})")
    if mode == "allowlist":
        raise FormatError(f"{FORMAT}: {name}: {which}.network_mode = 'allowlist' is not supported")
    if which == "agent":
        return "adapter-only"  # narrower than either mode: the policy's one way out is the adapter
    return mode


def _table(config: dict, key: str, name: str) -> dict:
    value = config.get(key, {})
    if not isinstance(value, dict):
        raise FormatError(f"{FORMAT}: {name}: [{key}] must be a table")
    return value


def _number(table: dict, key: str, default: float, name: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise FormatError(f"{FORMAT}: {name}: {key} must be a positive number, got {value!r}")
    return float(value)


def _megabytes(table: dict, key: str, old_key: str, default: int, name: str) -> int:
    """``memory_mb`` (a number), or the older ``memory = "2G"`` spelling."""
    if key in table:
        return int(_number(table, key, default, name))
    if old_key not in table:
        return default
    match = SIZE.match(str(table[old_key]))
    if match is None:
        raise FormatError(f"{FORMAT}: {name}: {old_key} must be a size like '2G', got {table[old_key]!r}")
    scale = {"": 1 / 2**20, "k": 1 / 1024, "m": 1, "g": 1024, "t": 2**20}[match[2].lower()]
    return max(1, int(float(match[1]) * scale))


def _string(table: dict, key: str, name: str) -> str | None:
    value = table.get(key)
    if value is not None and not isinstance(value, str | int):
        raise FormatError(f"{FORMAT}: {name}: {key} must be a string")
    return None if value is None else str(value)


def _env(table: dict, which: str, name: str) -> dict[str, str]:
    value = table.get("env", {})
    if not isinstance(value, dict) or not all(isinstance(v, str | int | float) for v in value.values()):
        raise FormatError(f"{FORMAT}: {name}: [{which}] env must map names to strings")
    return {str(k): str(v) for k, v in value.items()}


def _ignored(config: dict) -> list[str]:
    """Every key rollbus does not act on, as ``table.key``."""
    out = [f"{k}" for k in config if k not in KNOWN[""]]
    out += ["metadata"] if "metadata" in config else []
    out += [f"task.{k}" for k in _as_dict(config.get("task")) if k != "name"]
    out += ["artifacts"] if "artifacts" in config else []
    for table in ("verifier", "agent", "solution", "environment"):
        out += [f"{table}.{k}" for k in _as_dict(config.get(table)) if k not in KNOWN[table]]
    return sorted(out)


def _as_dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-._") or "task"


def load_task(path: Path, revision: str | None = None) -> dict[str, Any]:
    """Read the task directory ``path`` (the I/O edge of :func:`read_task`)."""
    files: dict[str, bytes] = {}
    for file in sorted(path.rglob("*")):
        if file.is_file() and not file.is_symlink():
            files[file.relative_to(path).as_posix()] = file.read_bytes()
    return read_task(path.name, files, str(path.resolve()), revision)
