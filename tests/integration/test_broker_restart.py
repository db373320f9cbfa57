"""The embedded broker's life cycle on its own instance: kill -9 loses nothing acknowledged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollbus.kafka.broker import BrokerError, EmbeddedBroker, free_port
from rollbus.kafka.bus import Publisher
from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import create_topics
from tests.event_samples import SAMPLES

pytestmark = pytest.mark.kafka

ROLLOUTS = [f"r-{i}" for i in range(40)]


async def acknowledged_turns(bootstrap: str) -> set[str]:
    await create_topics(bootstrap, 3)
    async with Publisher(bootstrap) as bus:
        for rollout in ROLLOUTS:
            await bus.publish("turns", {**SAMPLES["turn"], "rollout_id": rollout})
    return set(ROLLOUTS)


async def replayed_turns(bootstrap: str) -> set[str]:
    return {d.record["rollout_id"] async for _, d in read(bootstrap, ReadPlan("turns"))}


def cli(state_dir: Path, port: int, action: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "rollbus",
        "broker",
        action,
        "--state-dir",
        str(state_dir),
        "--port",
        str(port),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))


async def test_kill_9_and_restart_keeps_acknowledged_events(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path, port=free_port())
    broker.start(timeout=120)
    try:
        with pytest.raises(BrokerError, match="already runs"):
            broker.start()
        sent = await acknowledged_turns(broker.bootstrap_servers)
        cluster_id = (broker.home / "cluster.id").read_text()
        broker.kill()
        assert not broker.is_running()
        broker.start(timeout=120)
        assert (broker.home / "cluster.id").read_text() == cluster_id
        assert await replayed_turns(broker.bootstrap_servers) == sent
    finally:
        broker.stop()
    assert not broker.is_running()


def test_cli_start_status_stop(tmp_path: Path) -> None:
    port = free_port()
    started = cli(tmp_path, port, "start")
    try:
        assert started.returncode == 0, started.stderr
        assert f"broker ready on 127.0.0.1:{port} in " in started.stdout
        status = cli(tmp_path, port, "status")
        assert status.returncode == 0 and f"127.0.0.1:{port}" in status.stdout
    finally:
        stopped = cli(tmp_path, port, "stop")
    assert "broker stopped" in stopped.stdout
    assert cli(tmp_path, port, "status").returncode == 1
