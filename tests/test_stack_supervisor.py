"""The stack supervisor with real child processes: readiness, restart with backoff, no orphans on any stop."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import psutil
import pytest

from rollbus.kafka.broker import EmbeddedBroker, free_port
from rollbus.kafka.topics import create_topics, describe, topic_name
from rollbus.polling import wait_until_async
from rollbus.services.stack.supervisor import ServiceSpec, StackFailed, Supervisor
from tests.waiting import until

PY = sys.executable
# a child that starts a grandchild in its own process group and records both pids
FAMILY = (
    "import subprocess, sys, time, pathlib;"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    "pathlib.Path(sys.argv[1]).write_text(f'{g.pid}');"
    "time.sleep(600)"
)


def sleeper(name: str, settle: float = 0.3) -> ServiceSpec:
    return ServiceSpec(name, [PY, "-c", "import time; time.sleep(600)"], settle=settle)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_starts_after_what_it_needs_and_stops_children_and_grandchildren(tmp_path):
    port = free_port()
    pid_file = tmp_path / "grandchild.pid"
    specs = [
        ServiceSpec("web", [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                    health_url=f"http://127.0.0.1:{port}/"),
        ServiceSpec("family", [PY, "-c", FAMILY, str(pid_file)], settle=0.5, after=("web",)),
    ]  # fmt: skip
    events = []
    async with Supervisor(specs, tmp_path / "logs", on_event=lambda n, w: events.append((n, w))) as stack:
        pids = [child.proc.pid for child in stack.children]
        assert all(alive(pid) for pid in pids)
        await until(lambda: pid_file.exists() and pid_file.read_text(), "the grandchild's pid")
        grandchild = int(pid_file.read_text())
        assert alive(grandchild)
    assert events[:2] == [("web", "ready"), ("family", "ready")]
    assert not any(alive(pid) for pid in [*pids, grandchild])


async def test_children_start_together_unless_they_come_after_another(tmp_path):
    ready_at: dict[str, float] = {}
    after_a = ServiceSpec("c", [PY, "-c", "import time; time.sleep(600)"], settle=0.1, after=("a",))
    specs = [sleeper("a", settle=1.0), sleeper("b", settle=1.0), after_a]
    on_event = lambda name, what: ready_at.setdefault(name, time.monotonic())  # noqa: E731
    async with Supervisor(specs, tmp_path, on_event=on_event) as stack:
        assert stack["b"].started_at < ready_at["a"], "b waited for a, which it does not come after"
        assert stack["c"].started_at >= ready_at["a"], "c started before a, which it comes after, was ready"
        assert all(child.running for child in stack.children)


async def test_a_crashed_child_is_restarted_with_backoff(tmp_path):
    stack = Supervisor([sleeper("a")], tmp_path, backoff_initial=0.2, backoff_max=0.4)
    await stack.start()
    watcher = asyncio.create_task(stack.watch(poll=0.05))
    try:
        first = stack["a"].proc.pid
        os.kill(first, 9)
        await until(lambda: stack["a"].restarts == 1 and stack["a"].running, "a restarted")
        assert stack["a"].restarts == 1 and stack["a"].proc.pid != first and stack["a"].running
        assert stack["a"].backoff == 0.2
    finally:
        await stack.stop()
        await watcher
    assert not stack["a"].running


async def test_a_child_crashing_past_its_budget_fails_the_stack(tmp_path):
    code = "import time; time.sleep(0.4); raise SystemExit(3)"
    crasher = ServiceSpec("crasher", [PY, "-c", code], settle=0.1)
    stack = Supervisor([crasher], tmp_path, backoff_initial=0.01, backoff_max=0.01, max_restarts=2)
    await stack.start()
    with pytest.raises(StackFailed, match="crasher crashed 2 times"):
        await asyncio.wait_for(stack.watch(poll=0.02), 30)
    await stack.stop()


async def test_a_failure_during_start_up_stops_what_already_started(tmp_path):
    broken = ServiceSpec("broken", [PY, "-c", "print('no config'); raise SystemExit(2)"], settle=5)
    stack = Supervisor([sleeper("first"), broken], tmp_path)
    with pytest.raises(StackFailed, match="broken exited during start-up:\nno config"):
        await stack.start()
    assert not stack["first"].running


async def test_interrupted_during_start_up_leaves_no_orphans(tmp_path):
    """Ctrl-C while the second service is still starting: the first, already up, is stopped too."""
    stack = Supervisor([sleeper("first", settle=0.1), sleeper("slow", settle=60)], tmp_path)
    starting = asyncio.create_task(stack.start())
    await until(lambda: stack["slow"].proc is not None, "slow started")
    pids = [child.proc.pid for child in stack.children]
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not any(alive(pid) for pid in pids)


async def test_an_on_failure_service_that_exits_cleanly_is_done_not_restarted(tmp_path):
    ended = tmp_path / "trainer-ended"
    trainer = f"import pathlib, time; time.sleep(0.3); pathlib.Path({str(ended)!r}).touch()"
    finite = ServiceSpec("trainer", [PY, "-c", trainer], settle=0.1, restart="on-failure")
    # crashes once the trainer ended: once the loop has restarted it, it would have restarted the trainer too
    crash = f"import pathlib, time\nwhile not pathlib.Path({str(ended)!r}).exists(): time.sleep(0.02)\n"
    later = ServiceSpec("later", [PY, "-c", crash + "time.sleep(0.5); raise SystemExit(3)"], settle=0.1)
    stack = Supervisor([finite, later], tmp_path / "logs", backoff_initial=0.01)
    await stack.start()
    watcher = asyncio.create_task(stack.watch(poll=0.02))
    await until(lambda: stack["later"].restarts >= 1, "the later crash restarted")
    assert stack["trainer"].done and stack["trainer"].restarts == 0
    await stack.stop()
    await watcher


# a client that dies with its broker, as the services do: exits 3 once the port stops answering
CLIENT = (
    "import sys, time; from rollbus.kafka.broker import port_is_open;"
    "port = int(sys.argv[1]);"
    "exec('while port_is_open(port): time.sleep(0.1)');"
    "raise SystemExit(3)"
)


@pytest.mark.kafka
async def test_a_killed_broker_is_started_again_on_its_data_and_port_and_its_clients_with_it(tmp_path):
    """What failed: under `rollbus up` a SIGKILL of the embedded broker was never recovered; the services
    crash-looped against a port nobody listened on, and the run waited forever."""
    broker = EmbeddedBroker(tmp_path / "state", port=free_port())
    broker.start(timeout=120)
    events: list[tuple[str, str]] = []
    # a backoff far beyond the test's patience: the client comes back because the broker did, not by waiting
    client = ServiceSpec("client", [PY, "-c", CLIENT, str(broker.port)], settle=0.3)
    stack = Supervisor([client], tmp_path / "logs", backoff_initial=600, backoff_max=600, ready_timeout=120,
                       broker=broker, on_event=lambda n, w: events.append((n, w)))  # fmt: skip
    try:
        await create_topics(broker.bootstrap_servers, 1, "before")
        await stack.start()
        watcher = asyncio.create_task(stack.watch(poll=0.05))
        first_broker, first_client = broker.pid(), stack["client"].proc.pid
        os.kill(first_broker, signal.SIGKILL)

        async def recovered() -> bool:
            assert not watcher.done(), watcher
            return broker.is_running() and stack["client"].running and stack["client"].restarts == 1

        await wait_until_async(recovered, timeout=180, interval=0.2, what=f"broker and client back {events}")
        assert broker.pid() != first_broker and stack["client"].proc.pid != first_client
        assert any(name == "broker" and what.startswith("restarted (1)") for name, what in events), events
        # the same port and the same data: the topic made before the kill is still there
        assert await describe(broker.bootstrap_servers, [topic_name("tasks", "before")])
        await stack.stop()
        await watcher
    finally:
        await stack.stop()
        broker.stop()
    assert not stack["client"].running and not broker.is_running()
