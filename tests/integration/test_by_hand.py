"""The README's "Using it by hand" flow, as a person meets it: no flags, port 9092 taken by something else,
a broker that is not there, one that goes away under `tail` and comes back.

Each command runs as a subprocess (``python -m rollbus``) in a fresh working directory, so the defaults a
person gets (``.rollbus`` there, no ``ROLLBUS_*`` variables) are the ones exercised.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollbus.config import recorded_bootstrap
from rollbus.kafka.broker import free_port
from rollbus.kafka.bus import Publisher
from tests.event_samples import SAMPLES
from tests.waiting import until_sync

ROOT = Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    """The environment of a person with nothing configured (this clone's code on the path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBUS_") or k == "ROLLBUS_CACHE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def rollbus(cwd: Path, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollbus", *argv], cwd=cwd, env=clean_env(), capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


def assert_one_line_error(done: subprocess.CompletedProcess[str], address: str) -> None:
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert address in lines[0] and "rollbus broker start" in lines[0] and "--bootstrap-servers" in lines[0]
    assert "Traceback" not in done.stderr and "Unclosed" not in done.stderr


@pytest.mark.parametrize(
    "argv",
    [("replay", "turns"), ("replay", "turns", "--format", "table"), ("tail", "turns"), ("topics", "list"),
     ("topics", "create")],
)  # fmt: skip
def test_unreachable_broker_is_one_line_exit_1(tmp_path: Path, argv: tuple[str, ...]) -> None:
    address = f"127.0.0.1:{free_port()}"  # nobody listens: connections are refused
    done = rollbus(tmp_path, *argv, "--bootstrap-servers", address, "--connect-timeout", "3", timeout=60)
    assert_one_line_error(done, address)


def test_unanswering_broker_gives_up_after_the_connect_timeout(tmp_path: Path) -> None:
    """A port that accepts connections but never speaks Kafka: the command still ends, with one line, in
    the time asked (subprocess timeout as the bound)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        done = rollbus(tmp_path, "replay", "turns", "--bootstrap-servers", address, "--connect-timeout", "2",
                       timeout=60)  # fmt: skip
    assert_one_line_error(done, address)
    assert "waited up to 2s" in done.stderr


@pytest.fixture
def port_9092_taken() -> Iterator[None]:
    """Something else on 9092 (if nothing is there already)."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 9092))
        holder.listen()
    except OSError:
        pass  # already taken by someone else: just as good
    try:
        yield
    finally:
        holder.close()


async def publish_turn(bootstrap: str, rollout_id: str) -> None:
    async with Publisher(bootstrap) as bus:
        await bus.publish("turns", {**SAMPLES["turn"], "rollout_id": rollout_id})


def wait_for_text(path: Path, text: str, proc: subprocess.Popen[str], limit: float = 60) -> None:
    """Until ``text`` is in ``path``; fails at once if ``proc`` (which writes it) exited."""

    def written() -> bool:
        if text in path.read_text():
            return True
        assert proc.poll() is None, path.read_text()
        return False

    until_sync(written, repr(text), timeout=limit, interval=0.2, log=path.read_text)


@pytest.mark.kafka
def test_by_hand_flow_with_9092_taken_needs_no_flags(tmp_path: Path, port_9092_taken: None) -> None:
    started = rollbus(tmp_path, "broker", "start")
    try:
        assert started.returncode == 0, started.stderr
        address = recorded_bootstrap(tmp_path / ".rollbus")
        assert address is not None and address != "127.0.0.1:9092"
        assert "9092 is taken" in started.stderr and address in started.stdout
        again = rollbus(tmp_path, "broker", "start")
        assert again.returncode == 0 and address in again.stdout  # the real port, not the default
        assert rollbus(tmp_path, "topics", "create").returncode == 0
        empty = rollbus(tmp_path, "replay", "turns", "--format", "table")
        assert empty.returncode == 0 and empty.stdout == ""
        assert empty.stderr.strip() == "no events in turns from the beginning"
        asyncio.run(publish_turn(address, "r-[by-hand]"))
        found = rollbus(tmp_path, "replay", "turns", "--key", "r-[by-hand]", "--format", "table")
        assert found.returncode == 0 and "r-[by-hand]" in found.stdout.splitlines()[1]
        none = rollbus(tmp_path, "replay", "turns", "--key", "nobody")
        assert none.stderr.strip() == "no events in turns from the beginning with key nobody"
        follow_through_a_broker_restart(tmp_path, address)
    finally:
        rollbus(tmp_path, "broker", "stop")


def probes_while_away(address: str, wanted: int, timeout: float = 60) -> None:
    """Listens on the stopped broker's port until ``wanted`` of the tail's probes (a Kafka request from
    client id ``rollbus-probe``) came, closing every connection unanswered: to the tail the broker is away."""
    host, port = address.rsplit(":", 1)
    seen, deadline = 0, time.monotonic() + timeout
    with socket.create_server((host, int(port))) as server:
        while seen < wanted:
            server.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                raise AssertionError(f"{seen} of {wanted} probes in {timeout:.0f} s") from None
            with conn:
                conn.settimeout(5)
                try:
                    seen += b"rollbus-probe" in conn.recv(4096)
                except OSError:
                    pass


def follow_through_a_broker_restart(cwd: Path, address: str) -> None:
    """``tail`` says it follows, says once that the broker went away, keeps quiet, says it is back, and
    prints what comes after."""
    err, out = cwd / "tail.err", cwd / "tail.out"
    with err.open("w") as stderr, out.open("w") as stdout:
        command = [sys.executable, "-m", "rollbus", "tail", "turns", "--format", "table"]
        tail = subprocess.Popen(command, cwd=cwd, env=clean_env(), stdout=stdout, stderr=stderr, text=True)
    try:
        wait_for_text(err, f"following turns from the end on {address}, Ctrl-C to stop", tail)
        assert rollbus(cwd, "broker", "stop").returncode == 0
        wait_for_text(err, f"lost the broker at {address}", tail)
        probes_while_away(address, 2)  # retrying meanwhile, quietly (the line count below)
        assert rollbus(cwd, "broker", "start").returncode == 0
        wait_for_text(err, "is back", tail)
        asyncio.run(publish_turn(address, "r-after"))
        wait_for_text(out, "r-after", tail)
    finally:
        tail.terminate()
        tail.wait(30)
    lines = err.read_text().splitlines()
    assert len(lines) == 3, lines
    assert "Traceback" not in err.read_text()
