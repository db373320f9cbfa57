"""`docker compose up` for real: the design card's deployment, on the project's own Docker engine.

The images come from ``rollbus images build`` (no registry needed; cached, so a run with nothing changed
builds nothing); Compose is Debian's v1.29. One stack for the module, started as a user would start it
(``compose/docker-compose.yml`` with ``compose/demo.yml``): the demo's tasks go in, every rollout runs in a
sibling container the runner starts through the engine's socket and is graded in another, rewards and
segments come out, the trainer takes a step and the engine serves the new policy version. A service killed
mid-run (SIGKILL of its process: a crash; ``docker kill`` would count as an operator's stop, which the restart
policy honours) is restarted by its restart policy and nothing is lost: one reward per rollout, and the live
segments equal a rebuild from the raw topics. (A runner killed mid-rollout in the same stack was tried and
left out: at load ~10 on 2 cores the call took 139 s with it and 70 s without, more than the half-minute this
test may grow by; tests/integration/test_pipeline_faults.py kills the runner under ``rollbus up``.) Every
sandbox's disk is an engine-made tmpfs volume of fixed size (the runner's own mounts are invisible to the
engine). ``down -v`` leaves no container, network, volume or sandbox behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# a cold build of the images (a fresh machine, a changed lock) takes about ten minutes before the stack starts
pytestmark = [pytest.mark.compose, pytest.mark.docker, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
FILES = ["-f", str(ROOT / "compose" / "docker-compose.yml"), "-f", str(ROOT / "compose" / "demo.yml")]
DEADLINE_S = 420.0  # the whole loop, once the stack is up; on a quiet machine it takes about a minute
POLL_S = 3.0


class Stack:
    """One Compose project: its name, its environment, and the commands a user would type."""

    def __init__(self, project: str, env: dict[str, str]) -> None:
        self.project, self.env = project, env

    def compose(self, *args: str, timeout: float = 300.0, check: bool = True) -> subprocess.CompletedProcess:
        exe = shutil.which("docker-compose")
        assert exe, "docker-compose is not installed: scripts/bootstrap.sh --test installs Debian's"
        done = subprocess.run(
            [exe, "-p", self.project, *FILES, *args], env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False, cwd=ROOT,
        )  # fmt: skip
        if check:
            assert done.returncode == 0, f"docker-compose {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
        return done

    def rollbus(self, *args: str, timeout: float = 120.0) -> str:
        """``rollbus ARGS`` in the running segmenter's container (what a user runs to submit or inspect)."""
        return self.compose("exec", "-T", "segmenter", "rollbus", *args, timeout=timeout).stdout

    def events(self, topic: str, full: bool = False) -> list[dict[str, Any]]:
        full_arrays = ["--full"] if full else []
        out = self.rollbus("replay", topic, "--from-beginning", "--format", "json", *full_arrays)
        return [record_of(json.loads(line)) for line in out.splitlines() if line.startswith("{")]

    def container(self, service: str) -> Any:
        from rollbus.sandbox.docker_engine import client

        labels = [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]
        (found,) = client().containers.list(filters={"label": labels})
        return found


def record_of(row: dict[str, Any]) -> dict[str, Any]:
    """The event's fields, whatever envelope ``rollbus replay --format json`` prints around them."""
    for key in ("event", "record", "value"):
        if isinstance(row.get(key), dict):
            return record_of(row[key])
    return row


def wait_for(what: str, probe: Callable[[], Any], timeout: float = DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(POLL_S)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    from rollbus.local_images.cli import build_all
    from rollbus.sandbox.docker_engine import client, docker_host

    host = docker_host()
    tags = build_all(client())
    # what sibling containers mount is named by host paths: one directory, at the same path on both sides
    shared = tempfile.mkdtemp(prefix="rollbus-compose-up-")
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "DOCKER_HOST": host,
        "DOCKER_SOCKET": host.removeprefix("unix://"), "SHARED_DIR": shared, "KAFKA_IMAGE": tags["kafka"],
        "ENGINE_API_KEY": secrets.token_hex(16), "ADAPTER_ADMIN_TOKEN": secrets.token_hex(16),
        "ADAPTER_SIGNING_KEY": secrets.token_hex(32), "GROUP_SIZE": "2", "ROLLOUT_BATCH_SIZE": "2",
        "ENGINE_HOST_PORT": str(free_port()), "ADAPTER_HOST_PORT": str(free_port()),  # beside other stacks
    }  # fmt: skip
    up = Stack(f"rollbus-test-{secrets.token_hex(4)}", env)
    try:
        up.compose("up", "-d", "--no-build", timeout=600)
        yield up
    finally:
        # each service's own tail: a failure names what stalled (the broker's chatter crowds out the rest)
        logs = [up.compose("logs", "--no-color", "--tail", "40", s, check=False).stdout[-4000:]
                for s in SERVICES]  # fmt: skip
        up.compose("down", "-v", "--remove-orphans", "-t", "5", check=False, timeout=300)
        print("\n".join(logs))
        subprocess.run(["rm", "-rf", shared], check=False)


SERVICES = ("trainer", "segmenter", "grader", "sandbox-runner", "adapter", "engine", "kafka")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def mounts_from(container: Any, shared: str) -> bool:
    return any(str(m.get("Source", "")).startswith(shared) for m in container.attrs.get("Mounts", []))


def leftovers(project: str, shared: str, sandbox_ids: set[str]) -> list[str]:
    """What of the project the engine still holds, and any sandbox container (tool
    containers included) or disk volume of the sandboxes its services started."""
    from rollbus.sandbox.docker_backend import LABEL
    from rollbus.sandbox.docker_engine import client

    engine = client()
    label = {"label": f"com.docker.compose.project={project}"}
    sandboxes = [
        c for c in engine.containers.list(all=True, filters={"label": LABEL})
        if mounts_from(c, shared) or c.labels.get(LABEL) in sandbox_ids
    ]  # fmt: skip
    ours = [v for v in engine.volumes.list(filters={"label": LABEL})]
    disks = [v for v in ours if v.attrs["Labels"][LABEL] in sandbox_ids]
    return [
        *(f"container {c.name}" for c in engine.containers.list(all=True, filters=label)),
        *(f"sandbox {c.name}" for c in sandboxes),
        *(f"network {n.name}" for n in engine.networks.list(filters=label)),
        *(f"volume {v.name}" for v in [*engine.volumes.list(filters=label), *disks]),
    ]


def test_compose_runs_the_loop_survives_a_crash_and_leaves_nothing_behind(stack: Stack) -> None:
    sandboxes = SandboxWatch(stack.env["SHARED_DIR"])
    started, marks = time.monotonic(), []  # each phase's time, printed at the end (the cost of each step)

    def mark(phase: str) -> None:
        marks.append(f"{time.monotonic() - started:6.1f} s  {phase}")

    stack.rollbus("submit", "examples/swe-mini/demo.jsonl", "--n-samples-per-prompt", "2")
    wait_for("a reward on the bus", lambda: stack.events("rewards"))
    mark("a reward")

    # a crash mid-run: the grader's process SIGKILLed from the host; Compose's restart policy brings it back
    # (a `docker kill` would not be restarted: the engine counts it as an operator's stop)
    grader = stack.container("grader")
    os.kill(int(grader.attrs["State"]["Pid"]), signal.SIGKILL)
    wait_for("the grader restarted", lambda: grader.reload() or grader.attrs["RestartCount"] >= 1, 120)

    # each of the 4 samples ends graded by the policy's work: on itself, or on the runner's re-run of it
    # (rollout id ``.r<N>``) where the infrastructure failed it (a slow start, the crash)
    def graded() -> list[dict[str, Any]] | None:
        rewards = stack.events("rewards")
        return rewards if sum(e["failure_class"] != "infrastructure" for e in rewards) >= 4 else None

    rewards = graded() or wait_for("every sample graded", graded)
    mark("the grader killed and restarted; every sample graded")
    by_rollout = Counter(e["rollout_id"] for e in rewards)
    assert set(by_rollout.values()) == {1}, f"one reward per rollout: {by_rollout}"
    policy = {e["rollout_id"]: e["reward"] for e in rewards if e["failure_class"] != "infrastructure"}
    assert len(policy) == 4 and 1.0 in policy.values(), policy
    assert {sample_of(r) for r in policy} == {sample_of(r) for r in by_rollout}, (policy, by_rollout)
    segments = wait_for("segments of every graded rollout", lambda: (s := stack.events("segments")) and
                        {e["rollout_id"] for e in s} >= set(policy) and s)  # fmt: skip
    assert {e["rollout_id"] for e in segments} <= set(by_rollout)

    # event sourcing's promise, through the crash: the live segments equal a rebuild from the raw topics
    attempts = iter(range(1, 1000))

    def rebuilt_equals_live() -> bool:
        into = f"rebuilt-{next(attempts)}"
        stack.rollbus("rebuild", "segments", "--into", into, timeout=300)
        return by_id(stack.events(into, full=True)) == by_id(stack.events("segments", full=True))

    wait_for("the live segments equal to a rebuild from the raw topics", rebuilt_equals_live)
    mark("segments; rebuilt equals live")
    trained = wait_for("a trained step", lambda: max((int(p["version"]) for p in stack.events("policy")),
                                                     default=0))  # fmt: skip
    assert wait_for("the engine serving it", lambda: served_version(stack) >= trained) and trained >= 1
    mark("a trained step served")
    sandboxes.close()
    sandboxes.check()

    project, shared = stack.project, stack.env["SHARED_DIR"]
    stack.compose("down", "-v", "--remove-orphans", "-t", "30", timeout=300)  # time to close their sandboxes
    assert leftovers(project, shared, sandboxes.ids()) == []
    mark("down -v, nothing left")
    print("\n".join(marks))


def by_id(segments: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Segments by id: a segment published twice (a retry) is one segment, and its contents must agree."""
    return {e["segment_id"]: e for e in segments}


def sample_of(rollout_id: str) -> str:
    """The sample a rollout id runs: ``G-1`` and its re-runs ``G.r2-1`` are the same sample."""
    group, _, index = rollout_id.rpartition("-")
    return f"{group.partition('.r')[0]}-{index}"


class SandboxWatch:
    """Every sandbox container the stack's services create, inspected as it is created (the engine's event
    stream, filtered by the sandboxes' label), so the threat model's line is checked on live containers."""

    def __init__(self, shared: str) -> None:
        from rollbus.sandbox.docker_backend import LABEL
        from rollbus.sandbox.docker_engine import client

        self.shared, self.engine, self.seen = shared, client(), []
        self.disks: dict[str, dict[str, str]] = {}  # volume name -> its driver options, as it was mounted
        self.stream = self.engine.events(decode=True, filters={"type": "container", "event": "create",
                                                               "label": LABEL})  # fmt: skip
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        import docker

        for event in self.stream:
            with contextlib.suppress(docker.errors.NotFound):
                attrs = self.engine.api.inspect_container(event["id"])
                if any(str(m.get("Source", "")).startswith(self.shared) for m in attrs.get("Mounts", [])):
                    for name in volume_mounts(attrs).values():
                        self.disks[name] = self.engine.api.inspect_volume(name)["Options"]
                    self.seen.append(attrs)  # this stack's (the engine is shared with other tests)

    def agents(self) -> bool:
        """An agent's command container has been made (the adapter's listener in its own namespace)."""
        return any(agent(a) for a in list(self.seen))

    def ids(self) -> set[str]:
        from rollbus.sandbox.docker_backend import LABEL

        return {a["Config"]["Labels"][LABEL] for a in self.seen}

    def close(self) -> None:
        self.stream.close()

    def check(self) -> None:
        """No sandbox got the engine's socket, a capability, a network but none (a loopback of its own), or a
        host path outside the shared directory; agents' command containers were made."""
        assert self.seen, "no sandbox container of the stack was seen"
        for attrs in self.seen:
            host, mounts = attrs["HostConfig"], attrs.get("Mounts", [])
            assert not any("docker.sock" in str(m.get("Source")) for m in mounts), attrs["Name"]
            assert all(str(m["Source"]).startswith(self.shared) for m in mounts if m.get("Type") == "bind"), (
                mounts
            )
            assert not host.get("Privileged") and not host.get("CapAdd") and host.get("CapDrop") == ["ALL"]
            assert host["NetworkMode"] == "none", attrs["Name"]
        assert self.agents()
        # the disk: every one writes to engine-made tmpfs volumes of fixed size (an agent's workspace and
        # HOME, its patch capture's workspace read-only, a grading container's HOME)
        for attrs in self.seen:
            volumes = volume_mounts(attrs)
            assert volumes, attrs["Mounts"]
            if agent(attrs):
                assert {"/home/agent", attrs["Config"]["WorkingDir"]} <= set(volumes), attrs["Mounts"]
            for name in volumes.values():
                options = self.disks[name]
                assert options["type"] == "tmpfs" and "size=" in options["o"], (name, options)


def agent(attrs: dict[str, Any]) -> bool:
    """An agent's command container: the runner made the adapter's listener in its network namespace."""
    from rollbus.sandbox.docker_backend import NETWORK_LABEL

    return (attrs["Config"].get("Labels") or {}).get(NETWORK_LABEL) == "adapter"


def volume_mounts(attrs: dict[str, Any]) -> dict[str, str]:
    """A container's volume mounts: where inside -> the volume's name."""
    return {m["Destination"]: m["Name"] for m in attrs.get("Mounts", []) if m.get("Type") == "volume"}


def served_version(stack: Stack) -> int:
    key = stack.env["ENGINE_API_KEY"]
    probe = (
        "import json, urllib.request as u; r = u.Request('http://engine:30000/get_model_info', "
        f"headers={{'authorization': 'Bearer {key}'}}); print(json.load(u.urlopen(r))['weight_version'])"
    )
    done = stack.compose("exec", "-T", "segmenter", "python", "-c", probe, check=False)
    value = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    return int(value) if value.isdigit() else -1
