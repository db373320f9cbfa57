"""An embedded, real Apache Kafka broker: jars from Maven Central, one KRaft node on loopback.

Why not a fake: the bus's guarantees (idempotence, transactions, read-committed, consumer-group
commits, recovery after ``kill -9``) are the broker's, so development and tests run the real thing.
The jars are resolved once by Maven into ``cache_dir()/kafka-<pom hash>/``; the broker runs as a
detached ``java`` process whose files live under ``<state dir>/kafka/``::

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
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from pathlib import Path

from rollbus.config import DEFAULT_STATE_DIR, add_option, cache_dir

KAFKA_DIR = Path(__file__).with_name("kafka")
POM = KAFKA_DIR / "pom.xml"
DEFAULT_PORT = 9092
# Small heap, serial GC: one node with a few topics needs little, and the machine has 2 cores.
JVM_OPTIONS = ("-Xms128m", "-Xmx512m", "-XX:+UseSerialGC", "-Djava.awt.headless=true")


class BrokerError(RuntimeError):
    """The broker could not be fetched, formatted, started or stopped; the message says why."""


# --- jars --------------------------------------------------------------------------------------


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


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a live (not zombie) Kafka JVM; guards against a recycled pid."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and b"kafka.Kafka" in cmdline


def render(template: str, target: Path, **values: object) -> None:
    text = string.Template((KAFKA_DIR / template).read_text()).substitute(values)
    target.write_text(text)


class EmbeddedBroker:
    """One single-node KRaft broker whose files live in ``state_dir/kafka``.

    The same directory may be started, killed and started again: the cluster id, the data and the
    controller port are kept, so a restart recovers the log rather than beginning a new cluster.
    """

    def __init__(self, state_dir: Path | str, port: int = DEFAULT_PORT) -> None:
        self.home = Path(state_dir).resolve() / "kafka"
        self.port = port
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.home / "logs" / "server.log"

    def pid(self) -> int | None:
        try:
            return int(json.loads((self.home / "broker.json").read_text())["pid"])
        except (FileNotFoundError, KeyError, ValueError):
            return None

    def is_running(self) -> bool:
        if self._process is not None and self._process.poll() is not None:
            return False  # reaped: our own child has exited
        pid = self.pid()
        return pid is not None and pid_alive(pid)

    def start(self, timeout: float = 60.0) -> float:
        """Format on first use, launch the JVM detached, wait until it answers; return seconds taken."""
        began = time.monotonic()
        if self.is_running():
            raise BrokerError(f"a broker already runs from {self.home} (pid {self.pid()})")
        if port_is_open(self.port):
            raise BrokerError(f"port {self.port} is already taken; pick another with --port")
        jars = fetch()
        controller_port = self._configure()
        self._format(jars)
        self._launch(jars, controller_port)
        wait_until_ready(self, timeout)
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

    def _java(self, jars: Path, main_class: str, *args: str) -> list[str]:
        config = f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}"
        return ["java", *JVM_OPTIONS, config, "-cp", f"{jars}/*", main_class, *args]

    def _format(self, jars: Path) -> None:
        """``StorageTool format`` once per state dir, with a cluster id chosen and kept here."""
        if (self.home / "data" / "meta.properties").exists():
            return
        id_file = self.home / "cluster.id"
        if not id_file.exists():
            id_file.write_text(cluster_id())
        command = self._java(
            jars,
            "kafka.tools.StorageTool",
            "format",
            "--ignore-formatted",
            "-t",
            id_file.read_text().strip(),
            "-c",
            str(self.home / "server.properties"),
        )
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BrokerError(f"kafka-storage format failed:\n{done.stdout}{done.stderr}")

    def _launch(self, jars: Path, controller_port: int) -> None:
        command = self._java(jars, "kafka.Kafka", str(self.home / "server.properties"))
        with open(self.home / "logs" / "stdout.log", "ab") as out:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.home,
            )
        record = {"pid": self._process.pid, "port": self.port, "controller_port": controller_port}
        (self.home / "broker.json").write_text(json.dumps(record))

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (Kafka shuts down cleanly), then SIGKILL if it has not exited within ``timeout``."""
        pid = self.pid()
        if pid is None or not self.is_running():
            return
        os.kill(pid, signal.SIGTERM)
        if not self._wait_exit(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean shutdown, the log is recovered at the next start."""
        pid = self.pid()
        if pid is not None and self.is_running():
            os.kill(pid, signal.SIGKILL)
            self._wait_exit(pid, 10.0)

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process is not None and self._process.pid == pid:
                if self._process.poll() is not None:
                    return True
            elif not pid_alive(pid):
                return True
            time.sleep(0.05)
        return False


def cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding (as StorageTool makes)."""
    return base64.urlsafe_b64encode(os.urandom(16)).decode().rstrip("=")


def wait_until_ready(broker: EmbeddedBroker, timeout: float) -> None:
    """Poll until a metadata request lists the broker; fail fast, with the log, if the JVM died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not broker.is_running():
            raise BrokerError(f"the broker exited during start-up; last log lines:\n{log_tail(broker)}")
        if port_is_open(broker.port) and answers_metadata(broker.bootstrap_servers):
            return
        time.sleep(0.1)
    raise BrokerError(f"the broker did not answer within {timeout:.0f}s; last log lines:\n{log_tail(broker)}")


def answers_metadata(bootstrap_servers: str, timeout: float = 5.0) -> bool:
    """True if a Kafka metadata request succeeds and names at least one broker.

    Runs the aiokafka client on a private event loop in a worker thread, so it is safe to call from
    sync code whether or not the caller's thread already runs an event loop.
    """

    async def probe() -> bool:
        from aiokafka import AIOKafkaClient
        from aiokafka.errors import KafkaError

        client = AIOKafkaClient(bootstrap_servers=bootstrap_servers, request_timeout_ms=int(timeout * 1000))
        try:
            await client.bootstrap()
            return bool(client.cluster.brokers())
        except KafkaError:
            return False
        finally:
            await client.close()

    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # refused connections during start-up are expected here
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, probe()).result()
    finally:
        quiet.setLevel(level)


def log_tail(broker: EmbeddedBroker, lines: int = 20) -> str:
    parts = []
    for path in (broker.home / "logs" / "stdout.log", broker.log_file):
        if path.exists():
            parts.extend(path.read_text(errors="replace").splitlines()[-lines:])
    return "\n".join(parts) or "(no log written)"


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` (from /proc), for status and the start-up benchmark."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# --- CLI ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("start", "stop", "status", "fetch"))
    add_option(parser, "--port", default=DEFAULT_PORT, type=int, help="broker port on 127.0.0.1")
    add_option(
        parser, "--state-dir", default=Path(DEFAULT_STATE_DIR), type=Path, help="local state directory"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for start or stop")


def run(args: argparse.Namespace) -> int:
    try:
        return run_action(args)
    except BrokerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def run_action(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        print(f"kafka jars in {fetch()}")
        return 0
    broker = EmbeddedBroker(args.state_dir, port=args.port)
    if args.action == "start":
        if broker.is_running():
            print(f"broker already running (pid {broker.pid()}) from {broker.home}")
            return 0
        took = broker.start(timeout=args.timeout)
        print(f"broker ready on {broker.bootstrap_servers} in {took:.1f}s (pid {broker.pid()})")
    elif args.action == "stop":
        was = broker.pid() if broker.is_running() else None
        broker.stop(timeout=args.timeout)
        print(f"broker stopped (pid {was})" if was else "broker not running")
    else:
        return print_status(broker)
    return 0


def print_status(broker: EmbeddedBroker) -> int:
    if not broker.is_running():
        print(f"broker not running ({broker.home})")
        return 1
    record = json.loads((broker.home / "broker.json").read_text())
    rss = rss_bytes(record["pid"]) / 2**20
    print(
        f"broker running: pid {record['pid']}, 127.0.0.1:{record['port']}, "
        f"controller :{record['controller_port']}, rss {rss:.0f} MiB, data {broker.home / 'data'}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rollbus.broker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
