"""Resource limits of a local sandbox: cgroups where the host lets us, rlimits where it does not.

Each sandbox gets its own cgroup (``rollbus-<id>``) in the controllers that exist and are writable: cgroup v2
(``memory.max``, ``pids.max``, ``cpu.max``, when the unified hierarchy delegates them) or v1
(``memory.limit_in_bytes``, ``pids.max``, ``cpu.cfs_quota_us``). The launcher joins it before exec, so every
process of the sandbox is counted. Without a cgroup, ``RLIMIT_AS`` and ``RLIMIT_NPROC`` stand in (weaker:
per process and per uid). A limit hit is read back from the controllers' event counters after the command,
so it is named (``memory_limit``, ``pids_limit``) and never guessed from an exit code.
"""

from __future__ import annotations

import contextlib
import os
import resource
from dataclasses import dataclass
from pathlib import Path

from rollbus.sandbox.base import FailureKind

CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Per-sandbox limits; ``None`` means unlimited. Each is a setting of the services that make sandboxes."""

    memory_bytes: int | None = 4096 * MIB
    pids: int | None = 1024
    cpus: float | None = 2.0  # CPU bandwidth, in cores
    cpu_time_s: int | None = None  # CPU seconds per process (RLIMIT_CPU)
    tmp_bytes: int | None = 1024 * MIB  # size of the private /tmp tmpfs
    disk_bytes: int | None = 4096 * MIB  # workspace + HOME, checked after each command
    output_bytes: int = 8 * MIB  # per stream, head and tail kept
    wall_s: float = 1800.0  # default deadline of one command


@dataclass
class Cgroups:
    """The sandbox's cgroup directories (v1: one per controller; v2: one) and their counters before a run."""

    version: int
    dirs: dict[str, Path]  # controller -> directory (v2: every controller maps to the same dir)

    @classmethod
    def create(cls, name: str, limits: Limits, root: Path = CGROUP_ROOT) -> Cgroups | None:
        """Make and configure the cgroup, or None when no usable controller exists (then rlimits apply)."""
        wanted = {"memory": limits.memory_bytes, "pids": limits.pids, "cpu": limits.cpus}
        wanted = {k: v for k, v in wanted.items() if v is not None}
        if not wanted:
            return None
        unified = root / "cgroup.controllers"
        if unified.exists():
            return cls._create_v2(name, limits, root, set(unified.read_text().split()) & set(wanted))
        dirs: dict[str, Path] = {}
        for controller in wanted:
            base = root / controller
            if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
                with contextlib.suppress(OSError):
                    (base / name).mkdir(exist_ok=True)
                    dirs[controller] = base / name
        if not dirs:
            return None
        group = cls(1, dirs)
        group._write_v1(limits)
        return group

    @classmethod
    def _create_v2(cls, name: str, limits: Limits, root: Path, controllers: set[str]) -> Cgroups | None:
        if not controllers or not os.access(root, os.W_OK):
            return None
        path = root / name
        try:
            path.mkdir(exist_ok=True)
        except OSError:
            return None
        group = cls(2, dict.fromkeys(controllers, path))
        if limits.memory_bytes is not None and "memory" in controllers:
            _write(path / "memory.max", limits.memory_bytes)
            _write(path / "memory.swap.max", 0, missing_ok=True)
        if limits.pids is not None and "pids" in controllers:
            _write(path / "pids.max", limits.pids)
        if limits.cpus is not None and "cpu" in controllers:
            _write(path / "cpu.max", f"{int(limits.cpus * 100_000)} 100000")
        return group

    def _write_v1(self, limits: Limits) -> None:
        if "memory" in self.dirs and limits.memory_bytes is not None:
            _write(self.dirs["memory"] / "memory.limit_in_bytes", limits.memory_bytes)
            _write(self.dirs["memory"] / "memory.memsw.limit_in_bytes", limits.memory_bytes, missing_ok=True)
        if "pids" in self.dirs and limits.pids is not None:
            _write(self.dirs["pids"] / "pids.max", limits.pids)
        if "cpu" in self.dirs and limits.cpus is not None:
            _write(self.dirs["cpu"] / "cpu.cfs_period_us", 100_000)
            _write(self.dirs["cpu"] / "cpu.cfs_quota_us", int(limits.cpus * 100_000))

    def procs_files(self) -> list[str]:
        """Where the launcher writes ``0`` (itself) to join (precomputed: the child may not allocate much).

        v1: ``tasks``, which moves the writing thread alone, the whole of the single-threaded launcher; unlike
        ``cgroup.procs`` the kernel then skips the global threadgroup lock and its RCU grace period, often the
        slowest step of a boot. v2: ``cgroup.procs``.
        """
        name = "tasks" if self.version == 1 else "cgroup.procs"
        return sorted({str(d / name) for d in self.dirs.values()})

    def counters(self) -> dict[str, int]:
        """OOM kills and refused forks so far (compared before/after a command)."""
        found = {"oom_kill": 0, "pids_max": 0}
        memory, pids = self.dirs.get("memory"), self.dirs.get("pids")
        if memory is not None:
            name = "memory.oom_control" if self.version == 1 else "memory.events"
            found["oom_kill"] = _field(memory / name, "oom_kill")
        if pids is not None:
            found["pids_max"] = _field(pids / "pids.events", "max")
        return found

    def destroy(self) -> None:
        """Remove the cgroups (kill leftovers first: a non-empty cgroup cannot be removed)."""
        for path in set(self.dirs.values()):
            with contextlib.suppress(OSError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
            with contextlib.suppress(OSError):
                path.rmdir()


def failure_from_counters(before: dict[str, int], after: dict[str, int]) -> FailureKind | None:
    """Which cgroup limit a command hit, from the counters around it."""
    if after.get("oom_kill", 0) > before.get("oom_kill", 0):
        return "memory_limit"
    if after.get("pids_max", 0) > before.get("pids_max", 0):
        return "pids_limit"
    return None


def rlimits(limits: Limits, cgroups: Cgroups | None) -> list[tuple[int, int]]:
    """The rlimits the launcher sets: CPU time always (if asked), memory and processes without a cgroup."""
    found: list[tuple[int, int]] = []
    have = set(cgroups.dirs) if cgroups else set()
    if limits.cpu_time_s is not None:
        found.append((resource.RLIMIT_CPU, limits.cpu_time_s))
    if limits.memory_bytes is not None and "memory" not in have:
        found.append((resource.RLIMIT_AS, limits.memory_bytes))
    if limits.pids is not None and "pids" not in have:
        found.append((resource.RLIMIT_NPROC, limits.pids))
    return found


def enforcement(limits: Limits, cgroups: Cgroups | None, disk: str) -> dict[str, str]:
    """How each limit holds, for the start-up log (``{"memory": "cgroup v1", ...}``)."""
    have = {k: f"cgroup v{cgroups.version}" for k in cgroups.dirs} if cgroups else {}
    fallback = {
        "memory": "rlimit RLIMIT_AS (per process)",
        "pids": "rlimit RLIMIT_NPROC (per uid)",
        "cpu": "not enforced (no cpu controller)",
    }
    found = {}
    for key, value in (("memory", limits.memory_bytes), ("pids", limits.pids), ("cpu", limits.cpus)):
        found[key] = "off" if value is None else have.get(key, fallback[key])
    found["cpu_time"] = "off" if limits.cpu_time_s is None else "rlimit RLIMIT_CPU (per process)"
    found["tmp"] = "off" if limits.tmp_bytes is None else "tmpfs size"
    found["disk"] = "off" if limits.disk_bytes is None else disk
    found["output"] = "head+tail capture"
    found["wall_clock"] = "kill of the pid namespace"
    return found


def _write(path: Path, value: object, missing_ok: bool = False) -> None:
    try:
        path.write_text(str(value))
    except FileNotFoundError:
        if not missing_ok:
            raise


def _field(path: Path, key: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0
