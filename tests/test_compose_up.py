"""`docker compose up` for real: the design card's deployment, on the project's own Docker engine.

The images come from ``rollbus images build`` (no registry needed); Compose is Debian's v1.29. One stack
for the module: the demo's tasks go in, rewards, segments and a trained step come out and the engine serves
the new policy version; a service SIGKILLed mid-run is restarted by its restart policy and nothing is lost;
``down -v`` leaves nothing behind.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.compose, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[1]
FILES = ["-f", str(ROOT / "compose" / "docker-compose.yml"), "-f", str(ROOT / "compose" / "demo.yml")]
DEADLINE_S = 600.0


class Stack:
    """One Compose project: its name, its environment, and the commands a user would type."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.project, self.env = project, env

    def compose(self, *args: str, timeout: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
        exe = shutil.which("docker-compose")
        assert exe, "docker-compose is not installed: scripts/bootstrap.sh installs Debian's docker-compose"
        done = subprocess.run(
            [exe, "-p", self.project, *FILES, *args], env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False, cwd=ROOT,
        )  # fmt: skip
        if check:
            assert done.returncode == 0, f"docker-compose {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    def rollbus(self, *args: str, timeout: float = 120.0) -> str:
        """``rollbus ARGS`` in a one-off container of the stack (what a user runs to submit or inspect)."""
        return self.compose("run", "--rm", "--no-deps", "-T", "segmenter", *args, timeout=timeout).stdout

    def events(self, topic: str) -> list[dict[str, Any]]:
        out = self.rollbus("replay", topic, "--from-beginning", "--format", "json", "--connect-timeout", "30")
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return [row["event"]["record"] for row in rows if "event" in row]


def wait_for(what: str, probe: Callable[[], Any], timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(2.0)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    from rollbus.images.cli import build_all
    from rollbus.sandbox.docker_engine import client, docker_host

    engine = client()
    tags = build_all(engine)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin", "DOCKER_HOST": docker_host(), "KAFKA_IMAGE": tags["kafka"],
        "ENGINE_API_KEY": secrets.token_hex(16), "ADAPTER_ADMIN_TOKEN": secrets.token_hex(16),
        "ADAPTER_SIGNING_KEY": secrets.token_hex(32), "GROUP_SIZE": "2", "ROLLOUT_BATCH_SIZE": "2",
    }  # fmt: skip
    up = Stack(f"rollbus-test-{secrets.token_hex(4)}", env)
    try:
        up.compose("up", "-d", timeout=600)
        yield up
    finally:
        logs = up.compose("logs", "--no-color", "--tail", "40", check=False).stdout
        up.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=300)
        print(logs[-6000:])


def compose_leftovers(project: str) -> list[str]:
    from rollbus.sandbox.docker_engine import client

    engine = client()
    label = {"label": f"com.docker.compose.project={project}"}
    return [
        *(f"container {c.name}" for c in engine.containers.list(all=True, filters=label)),
        *(f"network {n.name}" for n in engine.networks.list(filters=label)),
        *(f"volume {v.name}" for v in engine.volumes.list(filters=label)),
    ]


def test_compose_runs_the_loop_survives_a_crash_and_leaves_nothing_behind(stack: Stack) -> None:
    stack.rollbus("submit", "examples/swe-mini/demo.jsonl", "--n-samples-per-prompt", "2")
    first = wait_for("a reward on the bus", lambda: stack.events("rewards"))
    # a crash mid-run: the grader's process SIGKILLed from the host; its restart policy brings it back
    from rollbus.sandbox.docker_engine import client

    engine = client()
    grader = engine.containers.list(filters={"label": [f"com.docker.compose.project={stack.project}",
                                                        "com.docker.compose.service=grader"]})[0]  # fmt: skip
    pid = grader.attrs["State"]["Pid"]
    subprocess.run(["kill", "-9", str(pid)], check=True)
    wait_for("the grader restarted", lambda: grader.reload() or grader.attrs["RestartCount"] >= 1, 120)

    rewards = wait_for("a reward for every rollout", lambda: (r := stack.events("rewards")) and len(
        {e["rollout_id"] for e in r}) == 4 and r)  # fmt: skip
    assert len(first) >= 1
    by_rollout: dict[str, list[float]] = {}
    for event in rewards:
        by_rollout.setdefault(event["rollout_id"], []).append(event["reward"])
    assert sorted(min(v) for v in by_rollout.values()) == [0.0, 0.0, 1.0, 1.0], by_rollout
    segments = wait_for("segments", lambda: stack.events("segments"))
    assert {s["rollout_id"] for s in segments} == set(by_rollout)
    steps = wait_for("a trained step", lambda: stack.events("policy"))
    version = max(int(p["version"]) for p in steps)
    served = wait_for("the engine serving it", lambda: (v := served_version(stack)) >= version and v)
    assert served >= 1

    project = stack.project
    stack.compose("down", "-v", "--remove-orphans", "-t", "5", timeout=300)
    assert compose_leftovers(project) == []


def served_version(stack: Stack) -> int:
    key = stack.env["ENGINE_API_KEY"]
    probe = (
        "import json, urllib.request as u; r = u.Request('http://engine:30000/get_model_info', "
        f"headers={{'authorization': 'Bearer {key}'}}); print(json.load(u.urlopen(r))['weight_version'])"
    )
    done = stack.compose("exec", "-T", "engine", "python", "-c", probe, check=False)
    value = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return int(value) if value.isdigit() else -1
