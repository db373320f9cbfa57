"""An embedded, real Apache Kafka broker: jars from Maven Central, one KRaft node on loopback.

Why not a fake: the bus's guarantees (idempotence, transactions, read-committed, consumer-group
commits, recovery after ``kill -9``) are the broker's, so development and tests run the real thing.
The jars come from :mod:`rollbus.kafka.runtime` (Maven Central, cached outside the clone); the broker
runs as a detached ``java`` process whose files live under ``<state dir>/kafka/``::

    kafka/server.properties, log4j2.properties   rendered from rollbus/kafka/ at every start
    kafka/cluster.id                              chosen once; ``StorageTool format`` runs once
    kafka/data/                                   the log (topics and the KRaft metadata log)
    kafka/logs/server.log, logs/stdout.log        broker log, JVM output
    kafka/broker.json                             pid and ports of the running broker

Durability: producers use ``acks=all``; with one replica an acknowledged write is in the OS page
cache, which a ``kill -9`` of the JVM does not lose (a power cut could: no fsync per write).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from rollbus.kafka.reach import reachable
from rollbus.kafka.runtime import BrokerError, adopt_archive, class_data_sharing, fetch, render
from rollbus.polling import WaitTimeout, wait_until
from rollbus.settings import DEFAULT_STATE_DIR, Field, Settings, shared

DEFAULT_PORT = 9092
# Small heap and serial GC: one node with a few topics needs little, and the machine has 2 cores.
# C1 only (TieredStopAtLevel=1): starts ~1 s sooner and uses ~30 MiB less, at some cost in peak
# throughput; ROLLBUS_BROKER_JVM_OPTIONS is appended, so "-XX:TieredStopAtLevel=4" undoes it.
JVM_OPTIONS = (
    "-Xms64m",
    "-Xmx512m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-Djava.awt.headless=true",
)


# --- the broker process ------------------------------------------------------------------------


def free_port() -> int:
    """A loopback port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def pid_alive(pid: int, config: Path) -> bool:
    """True if ``pid`` is a live (not zombie) Kafka JVM started with ``config``: a pid file can
    outlive its process, and the pid be reused by another."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        cmdline = process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "kafka.Kafka" in cmdline and str(config) in cmdline


class EmbeddedBroker:
    """One single-node KRaft broker whose files live in ``state_dir/kafka``.

    The same directory may be started, killed and started again: the cluster id, the data and the
    controller port are kept, so a restart recovers the log rather than beginning a new cluster.
    """

    def __init__(self, state_dir: Path | str, port: int = DEFAULT_PORT) -> None:
        self.home = Path(state_dir).resolve() / "kafka"
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.home / "logs" / "server.log"

    def record(self) -> dict[str, Any]:
        """What the last start wrote to ``broker.json`` (pid, ports, pending class archive)."""
        try:
            return json.loads((self.home / "broker.json").read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def pid(self) -> int | None:
        pid = self.record().get("pid")
        return int(pid) if pid is not None else None

    def is_running(self) -> bool:
        pid = self.pid()
        if self._process is not None and self._process.pid == pid:
            return self._process.poll() is None  # our own child: ask the kernel, and reap it
        return pid is not None and pid_alive(pid, self.home / "server.properties")

    def start(self, timeout: float = 60.0) -> float:
        """Format on first use, launch the JVM detached, wait until it answers; return seconds taken."""
        began = time.monotonic()
        if self.is_running():
            raise BrokerError(f"a broker already runs from {self.home} (pid {self.pid()})")
        if port_is_open(self.port):
            raise BrokerError(f"port {self.port} is already taken; pick another with --port")
        if shutil.which("java") is None:
            raise BrokerError("java is not on PATH; the embedded broker needs Java 17 or newer")
        jars = fetch()
        controller_port = self._configure()
        self._format(jars)
        self._launch(jars, controller_port)
        try:
            wait_until_ready(self, timeout)
        except BrokerError:
            self.kill()  # never leave a half-started JVM holding the ports and the log lock
            raise
        return time.monotonic() - began

    def _configure(self) -> int:
        """Write this start's config files; keep the controller port of earlier starts if free."""
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        saved = self.home / "controller.port"
        controller_port = int(saved.read_text()) if saved.exists() else free_port()
        if port_is_open(controller_port) or controller_port == self.port:
            controller_port = free_port()
        saved.write_text(str(controller_port))
        render(
            "server.properties",
            self.home / "server.properties",
            port=self.port,
            controller_port=controller_port,
            data_dir=self.home / "data",
        )
        render("log4j2.properties", self.home / "log4j2.properties", log_file=self.log_file)
        return controller_port

    def _java(self, jars: Path, *args: str) -> list[str]:
        """``java <options> -cp <jars>/* <args>``; ``args`` may start with more JVM options."""
        config = f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}"
        extra = shlex.split(os.environ.get("ROLLBUS_BROKER_JVM_OPTIONS", ""))
        return ["java", *JVM_OPTIONS, *extra, config, "-cp", f"{jars}/*", *args]

    def _format(self, jars: Path) -> None:
        """``StorageTool format`` once per state dir, with a cluster id chosen and kept here."""
        if (self.home / "data" / "meta.properties").exists():
            return
        id_file = self.home / "cluster.id"
        if not id_file.exists():
            id_file.write_text(cluster_id())
        cluster = f"--cluster-id={id_file.read_text().strip()}"
        config = f"--config={self.home / 'server.properties'}"
        command = self._java(jars, "kafka.tools.StorageTool", "format", "--ignore-formatted", cluster, config)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BrokerError(f"kafka-storage format failed:\n{done.stdout}{done.stderr}")

    def _launch(self, jars: Path, controller_port: int) -> None:
        sharing, pending_archive = class_data_sharing(jars)
        command = self._java(jars, *sharing, "kafka.Kafka", str(self.home / "server.properties"))
        with open(self.home / "logs" / "stdout.log", "ab") as out:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.home,
            )
        record = {
            "pid": self._process.pid,
            "port": self.port,
            "controller_port": controller_port,
            "pending_archive": pending_archive,
        }
        (self.home / "broker.json").write_text(json.dumps(record))

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (Kafka shuts down cleanly), then SIGKILL if it has not exited within ``timeout``."""
        pid = self.pid()
        if pid is None or not self.is_running():
            return
        os.kill(pid, signal.SIGTERM)
        clean = self._wait_exit(timeout)
        if not clean:
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(10.0)
        adopt_archive(self.record().get("pending_archive"), complete=clean)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean shutdown, the log is recovered at the next start."""
        pid = self.pid()
        if pid is not None and self.is_running():
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(10.0)
            adopt_archive(self.record().get("pending_archive"), complete=False)

    def _wait_exit(self, timeout: float) -> bool:
        try:
            wait_until(lambda: not self.is_running(), timeout=timeout, interval=0.05, what="broker exit")
        except WaitTimeout:
            return False
        return True


def cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 unpadded; like Kafka's own, never led
    by ``-``, which a command line would take for an option."""
    while True:
        text = base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def wait_until_ready(broker: EmbeddedBroker, timeout: float) -> None:
    """Poll until a metadata request lists the broker; fail fast, with the log, if the JVM died."""

    def ready() -> bool:
        if not broker.is_running():
            raise BrokerError(f"the broker exited during start-up; last log lines:\n{log_tail(broker)}")
        return port_is_open(broker.port) and answers_metadata(broker.bootstrap_servers)

    try:
        wait_until(ready, timeout=timeout, interval=0.1, what="broker start-up")
    except WaitTimeout:
        raise BrokerError(
            f"the broker did not answer within {timeout:.0f}s; last log lines:\n{log_tail(broker)}"
        ) from None


def answers_metadata(bootstrap_servers: str, timeout: float = 5.0) -> bool:
    """True if a Kafka metadata request succeeds and names at least one broker.

    :func:`~rollbus.kafka.reach.reachable` on a private event loop in a worker thread, so it is safe to call
    from sync code whether or not the caller's thread already runs an event loop.
    """
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # refused connections during start-up are expected here
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, reachable(bootstrap_servers, timeout)).result()
    finally:
        quiet.setLevel(level)


def log_tail(broker: EmbeddedBroker, lines: int = 20) -> str:
    parts = []
    for path in (broker.home / "logs" / "stdout.log", broker.log_file):
        if path.exists():
            parts.extend(path.read_text(errors="replace").splitlines()[-lines:])
    return "\n".join(parts) or "(no log written)"


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid``, for status and the start-up benchmark (0 if it is gone)."""
    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


# --- CLI ---------------------------------------------------------------------------------------


class BrokerSettings(Settings):
    """Settings of ``rollbus broker`` (flags ``--x-y``, variables ``ROLLBUS_BROKER_X_Y``)."""

    model_config = Settings.scoped("broker")

    state_dir: Path = Field(
        DEFAULT_STATE_DIR, validation_alias=shared("state_dir"), description="local state directory"
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description=f"broker port on 127.0.0.1 (unset: the port of the last start, else {DEFAULT_PORT}; "
        "a free one if that is taken)",
    )
    timeout: float = Field(60.0, gt=0, description="seconds to wait for start or stop")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop", "status", "fetch"))
    BrokerSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        return run_action(args)
    except BrokerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def run_action(parsed: argparse.Namespace) -> int:
    settings = BrokerSettings.from_args(parsed)
    if parsed.action == "fetch":
        print(f"kafka jars in {fetch()}")
        return 0
    broker = EmbeddedBroker(settings.state_dir, port=settings.port or DEFAULT_PORT)
    if parsed.action == "start":
        if broker.is_running():
            port = broker.record().get("port", broker.port)
            print(f"broker already running on 127.0.0.1:{port} (pid {broker.pid()}) from {broker.home}")
            return 0
        broker.port = start_port(broker, settings.port)
        took = broker.start(timeout=settings.timeout)
        print(f"broker ready on {broker.bootstrap_servers} in {took:.1f}s (pid {broker.pid()})")
    elif parsed.action == "stop":
        was = broker.pid() if broker.is_running() else None
        broker.stop(timeout=settings.timeout)
        print(f"broker stopped (pid {was})" if was else "broker not running")
    else:
        return print_status(broker)
    return 0


def start_port(broker: EmbeddedBroker, requested: int | None) -> int:
    """The port to start on: the one asked for; else the last start's (so clients that found it keep
    finding it), else the default; a free one, said on stderr, if that is taken. Commands on the same
    state dir find the broker wherever it listens through ``broker.json``."""
    if requested is not None:
        return requested
    port = int(broker.record().get("port") or DEFAULT_PORT)
    if port_is_open(port):
        chosen = free_port()
        print(f"port {port} is taken; starting on 127.0.0.1:{chosen} instead", file=sys.stderr)
        return chosen
    return port


def print_status(broker: EmbeddedBroker) -> int:
    if not broker.is_running():
        print(f"broker not running ({broker.home})")
        return 1
    record = broker.record()
    rss = rss_bytes(record["pid"]) / 2**20
    print(
        f"broker running: pid {record['pid']}, 127.0.0.1:{record['port']}, "
        f"controller :{record['controller_port']}, rss {rss:.0f} MiB, data {broker.home / 'data'}"
    )
    return 0

