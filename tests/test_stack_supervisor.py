"""The stack supervisor with real child processes: readiness, restart with backoff, no orphans on any stop."""

from __future__ import annotations

import asyncio
import os
import sys

import psutil
import pytest

from rollbus.broker import free_port
from rollbus.services.stack.supervisor import ServiceSpec, StackFailed, Supervisor

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


async def test_starts_in_order_and_stops_children_and_grandchildren(tmp_path):
    port = free_port()
    pid_file = tmp_path / "grandchild.pid"
    specs = [
        ServiceSpec("web", [PY, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                    health_url=f"http://127.0.0.1:{port}/"),
        ServiceSpec("family", [PY, "-c", FAMILY, str(pid_file)], settle=0.5),
    ]  # fmt: skip
    events = []
    async with Supervisor(specs, tmp_path / "logs", on_event=lambda n, w: events.append((n, w))) as stack:
        pids = [child.proc.pid for child in stack.children]
        assert all(alive(pid) for pid in pids)
        for _ in range(50):
            if pid_file.exists() and pid_file.read_text():
                break
            await asyncio.sleep(0.1)
        grandchild = int(pid_file.read_text())
        assert alive(grandchild)
    assert events[:2] == [("web", "ready"), ("family", "ready")]
    assert not any(alive(pid) for pid in [*pids, grandchild])


async def test_a_crashed_child_is_restarted_with_backoff(tmp_path):
    stack = Supervisor([sleeper("a")], tmp_path, backoff_initial=0.2, backoff_max=0.4)
    await stack.start()
    watcher = asyncio.create_task(stack.watch(poll=0.05))
    try:
        first = stack["a"].proc.pid
        os.kill(first, 9)
        for _ in range(100):
            if stack["a"].restarts == 1 and stack["a"].running:
                break
            await asyncio.sleep(0.05)
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
    for _ in range(100):
        if stack["slow"].proc is not None:
            break
        await asyncio.sleep(0.05)
    pids = [child.proc.pid for child in stack.children]
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not any(alive(pid) for pid in pids)


async def test_an_on_failure_service_that_exits_cleanly_is_done_not_restarted(tmp_path):
    argv = [PY, "-c", "import time; time.sleep(0.3)"]
    finite = ServiceSpec("trainer", argv, settle=0.1, restart="on-failure")
    stack = Supervisor([finite], tmp_path, backoff_initial=0.01)
    await stack.start()
    watcher = asyncio.create_task(stack.watch(poll=0.02))
    for _ in range(100):
        if stack["trainer"].done:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    assert stack["trainer"].done and stack["trainer"].restarts == 0
    await stack.stop()
    await watcher
