"""A native agent CLI shipped inside an npm package: pinned, installed once into the cache, run as is.

Both agent CLIs (Claude Code, Codex) ship their native binary in a per-platform npm package behind a thin
Node wrapper. We install with ``--ignore-scripts`` and use the platform binary directly, so nothing is fetched
at install time beyond the npm tarballs and Node is not needed at run time.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rollbus.config import cache_dir

MARKER = ".rollbus-installed.json"
NPM_FLAGS = ("--ignore-scripts", "--no-audit", "--no-fund", "--no-save", "--loglevel=error")


class CliNotInstalled(RuntimeError):
    """The pinned CLI is not in the cache: run its module's ``fetch``."""


class CliInstallError(RuntimeError):
    """npm ran but did not leave a working native binary behind."""


@dataclass(frozen=True)
class NpmBinary:
    """One pinned CLI: ``package@version`` from npm, its native binary found by ``binary_glob`` under the
    package's scope in ``node_modules``."""

    title: str  # "Claude Code"
    package: str  # "@anthropic-ai/claude-code"
    version: str
    cache_name: str  # the install directory is cache_dir() / f"{cache_name}-{version}"
    binary_glob: str  # relative to node_modules/<scope>/
    module: str  # the module whose ``fetch`` installs it, for messages
    npm_timeout_s: int = 600

    @property
    def execute_only_name(self) -> str:
        return f"{self.binary_glob.rsplit('/', 1)[-1]}.execute-only"

    def install_dir(self, version: str | None = None) -> Path:
        return cache_dir() / f"{self.cache_name}-{version or self.version}"

    def binary_path(self, version: str | None = None) -> Path:
        """Absolute path of the installed native binary (read from the install marker)."""
        version = version or self.version
        marker = self.install_dir(version) / MARKER
        if not marker.is_file():
            raise CliNotInstalled(
                f"{self.title} {version} is not installed in {self.install_dir(version)}; "
                f"run `python -m {self.module} fetch`"
            )
        return self.install_dir(version) / json.loads(marker.read_text())["binary"]

    def execute_only_binary(self, version: str | None = None) -> Path:
        """A copy of the installed binary that anyone may run and nobody but root may read (mode 0111).

        The kernel makes a process that runs a binary its user cannot read non-dumpable: its
        ``/proc/<pid>/mem``, ``/proc/<pid>/environ``, ``/proc/<pid>/fd`` and ptrace are closed to every
        process without ``CAP_SYS_PTRACE``, same-uid tools included. A sandbox that runs this copy keeps the
        CLI's memory, token and sockets from the tools it starts. Both CLIs run from the copy as is (Claude
        Code's Bun binary reads its bundled code from its own memory, Codex is a static binary). Made once
        per version, atomically.
        """
        source = self.binary_path(version)
        dest = self.install_dir(version) / self.execute_only_name
        with contextlib.suppress(FileNotFoundError):
            made = dest.stat()
            if stat.S_IMODE(made.st_mode) == 0o111 and made.st_size == source.stat().st_size:
                return dest
        staging = dest.with_name(f".{self.execute_only_name}.{os.getpid()}")
        try:
            shutil.copyfile(source, staging)
            staging.chmod(0o111)
            staging.replace(dest)
        finally:
            staging.unlink(missing_ok=True)
        return dest

    def fetch(self, version: str | None = None, *, npm: str = "npm") -> Path:
        """Install ``package@version`` into the cache unless the marker says it is there; return the binary.

        Installs into a temporary sibling directory and renames it into place, so a crash or a concurrent
        fetch never leaves a half-installed directory that looks complete.
        """
        version = version or self.version
        dest = self.install_dir(version)
        if (dest / MARKER).is_file():
            return self.binary_path(version)
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the binary from other users
        try:
            self._npm_install(npm, f"{self.package}@{version}", staging)
            binary = self._find_native_binary(staging)
            reported = _binary_version(binary)
            if version not in reported.split():  # "2.1.197 (Claude Code)", "codex-cli 0.169.0"
                raise CliInstallError(f"{binary} reports version {reported!r}, expected {version}")
            marker = {"version": version, "binary": str(binary.relative_to(staging))}
            (staging / MARKER).write_text(json.dumps(marker))
            if (dest / MARKER).is_file():  # a concurrent fetch finished first
                return self.binary_path(version)
            shutil.rmtree(dest, ignore_errors=True)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.binary_path(version)

    def _npm_install(self, npm: str, spec: str, prefix: Path) -> None:
        cmd = [npm, "install", "--prefix", str(prefix), *NPM_FLAGS, spec]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.npm_timeout_s, check=False
            )
        except FileNotFoundError as exc:
            raise CliInstallError(f"{npm!r} not found: install Node.js and npm") from exc
        if done.returncode != 0:
            raise CliInstallError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr.strip()}")

    def _find_native_binary(self, prefix: Path) -> Path:
        """The executable in the platform package npm picked for this os/cpu/libc."""
        scope = prefix / "node_modules" / self.package.split("/")[0]
        found = for_this_libc([p for p in sorted(scope.glob(self.binary_glob)) if os.access(p, os.X_OK)])
        if len(found) != 1:
            paths = [str(p) for p in found]
            raise CliInstallError(f"expected one native binary under {scope}, found {paths}")
        return found[0]


def _binary_version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise CliInstallError(f"{binary} --version failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


def for_this_libc(binaries: list[Path], libc: str | None = None) -> list[Path]:
    """The binaries whose platform package suits this machine's C library.

    Why: npm before 10.4 ignores a package's ``libc`` field and installs every optional platform package of
    the os/cpu, so Debian's npm 9 puts both ``*-linux-x64`` and ``*-linux-x64-musl`` beside each other. A
    musl build is kept only on a musl system, a glibc one only elsewhere; with one candidate, it stands.
    """
    if len(binaries) < 2:
        return binaries
    musl = (libc if libc is not None else platform.libc_ver()[0]) != "glibc"
    return [b for b in binaries if any(part.endswith("-musl") for part in b.parts) == musl]
