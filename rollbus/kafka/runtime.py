"""The Kafka runtime: jars from Maven Central, rendered config, a class-data archive for quick starts.

Everything here is cached outside the clone (``cache_dir()``) and keyed by what pins it, so a fresh
machine fetches once and a version bump fetches afresh, without anyone clearing caches by hand.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import string
import subprocess
import time
from pathlib import Path

from rollbus.config import cache_dir

KAFKA_DIR = Path(__file__).resolve().parent
POM = KAFKA_DIR / "pom.xml"


class BrokerError(RuntimeError):
    """The broker could not be fetched, formatted, started or stopped; the message says why."""


def jars_dir() -> Path:
    """Where the pom's jars live: keyed by the pom's hash, so a version bump fetches afresh."""
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
    return cache_dir() / f"kafka-{digest}"


def fetch() -> Path:
    """Copy Kafka and its runtime dependencies into :func:`jars_dir` (a no-op once complete)."""
    target = jars_dir()
    if (target / ".complete").exists():
        return target
    if shutil.which("mvn") is None:
        raise BrokerError("Maven (mvn) is not on PATH; it is needed once to fetch the Kafka jars")
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    command = [
        "mvn",
        "-q",
        "-B",
        "-f",
        str(POM),
        "dependency:copy-dependencies",
        "-DincludeScope=runtime",
        f"-DoutputDirectory={partial}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BrokerError(f"mvn failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    (partial / ".complete").touch()
    try:
        partial.rename(target)
    except OSError:  # another fetch finished first; its copy is as good as ours
        shutil.rmtree(partial, ignore_errors=True)
    return target


def render(template: str, target: Path, **values: object) -> None:
    """Fill a template of this directory (``$port`` and so on) into ``target``."""
    text = string.Template((KAFKA_DIR / template).read_text()).substitute(values)
    target.write_text(text)


def class_data_sharing(jars: Path) -> tuple[list[str], str | None]:
    """JVM options for an application class-data archive of Kafka's classes (halves a warm start).

    The first broker of a jars/JVM pair records its loaded classes into a pending file, written when
    it exits cleanly; :func:`adopt_archive` then moves it into place for every later start. The name
    is keyed by the java binary, so a JVM upgrade records afresh instead of ignoring a stale archive.
    Returns the options and the pending file to adopt (None when the archive is already there).
    """
    java = Path(shutil.which("java") or "java").resolve()
    stamp = java.stat()
    key = hashlib.sha256(f"{java}:{stamp.st_size}:{stamp.st_mtime_ns}".encode()).hexdigest()[:12]
    archive = jars / f"kafka-{key}.jsa"
    if archive.exists():
        return [f"-XX:SharedArchiveFile={archive}"], None
    pending = archive.with_name(f"{archive.name}.{os.getpid()}-{time.monotonic_ns()}")
    return [f"-XX:ArchiveClassesAtExit={pending}"], str(pending)


def adopt_archive(pending: str | None, complete: bool) -> None:
    """Move a class-data archive written at a clean exit into place (the first one wins); drop it
    if the JVM was killed, since it may be cut short."""
    if pending is None or not Path(pending).exists():
        return
    final = Path(pending.rsplit(".", 1)[0])
    if complete and not final.exists():
        os.replace(pending, final)
    else:
        Path(pending).unlink()
