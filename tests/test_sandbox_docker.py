"""The Docker backend attacked from inside, as a policy would: a real engine (started by the project where
none answers), the base image built from Debian's mirror (cached: once per machine), and a task image that
carries its fix in its repository's history.

Every probe runs inside a container of :class:`DockerSandbox` and reports what the kernel answered; a refusal
must come from the container's own network namespace (ECONNREFUSED on its loopback, ENETUNREACH elsewhere).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from rollbus import claude_cli, codex_cli
from rollbus.sandbox import docker_engine, docker_images
from rollbus.sandbox.base import SandboxError, SandboxPathError
from rollbus.sandbox.docker_backend import DockerSandbox
from rollbus.sandbox.limits import Limits
from tests.test_sandbox_isolation import PROBE, Adapter

pytestmark = pytest.mark.docker

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/home/agent"}
PORT = 4000
SMALL = Limits(memory_bytes=128 << 20, pids=64, cpus=1.0, tmp_bytes=8 << 20, disk_bytes=32 << 20)
# A task image whose repository holds its fix in every place a policy has looked for one: a later commit on
# another branch, tags, a stash, reflog entries, packed refs, packed objects, a remote-tracking ref.
# /future.txt (outside the repository) is the test's oracle: the ids of the later commit and the fixed blob.
HISTORY_IMAGE = "rollbus-test/history:1"
HISTORY_DOCKERFILE = r"""
FROM {base}
RUN set -e; mkdir /testbed; cd /testbed; export GIT_AUTHOR_NAME=a GIT_AUTHOR_EMAIL=a@b GIT_COMMITTER_NAME=a \
    GIT_COMMITTER_EMAIL=a@b; git init -q -b main; printf 'def add(a, b):\n    return a - b\n' > calc.py; \
    printf 'build/\n' > .gitignore; git add calc.py .gitignore; git commit -qm base; git checkout -qb fix; \
    printf 'def add(a, b):\n    return a + b  # FUTURE_FIX_MARKER\n' > calc.py; git commit -qam 'gold fix'; \
    git tag gold; git tag -a gold-annotated -m gold; git update-ref refs/remotes/origin/fix HEAD; \
    git rev-parse HEAD > /future.txt; git rev-parse HEAD:calc.py >> /future.txt; git pack-refs --all; \
    git repack -qad; git checkout -q main; echo FUTURE_FIX_MARKER > stash.txt; git add stash.txt; \
    git stash -q; git branch -D fix -q; mkdir build; echo made > build/out
"""


@pytest.fixture(scope="session")
def engine() -> Any:
    """The engine (the project's own, started here where none answers) and the cached base image."""
    client = docker_engine.client()
    docker_images.ensure_base_image(client)
    return client


@pytest.fixture(scope="session")
def history_image(engine: Any) -> str:
    base = docker_images.ensure_base_image(engine)
    dockerfile = HISTORY_DOCKERFILE.format(base=base).encode()
    engine.images.build(fileobj=io.BytesIO(dockerfile), tag=HISTORY_IMAGE, rm=True, network_mode="none")
    return HISTORY_IMAGE


@pytest.fixture
async def adapter() -> AsyncIterator[Adapter]:
    fake = Adapter()
    fake.server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    yield fake
    fake.server.close()


@pytest.fixture
async def agent(engine: Any, history_image: str, adapter: Adapter) -> AsyncIterator[DockerSandbox]:
    box = await DockerSandbox.create(
        history_image, client=engine, workdir="/testbed", limits=SMALL, network="adapter",
        adapter_url=adapter.url, forward_port=PORT,
    )  # fmt: skip
    async with box:
        yield box


async def make(engine: Any, image: str, limits: Limits = SMALL, **options: Any) -> DockerSandbox:
    return await DockerSandbox.create(image, client=engine, workdir="/testbed", limits=limits, **options)


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A listener of the test itself on host loopback: what the broker or the engine would be."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server.getsockname()[1]
    server.close()


@pytest.fixture
def abstract_socket() -> Iterator[str]:
    name = f"rollbus-test-{uuid.uuid4().hex[:8]}"
    server = socket.socket(socket.AF_UNIX)
    server.bind("\0" + name)
    server.listen()
    yield "@" + name
    server.close()


POST = (
    "import sys, urllib.request as u; r = u.Request(sys.argv[1], data=b'ping', headers={'X-Rollbus-Sandbox': "
    "'someone-else'}); print(u.urlopen(r, timeout=10).read().decode())"
)


async def test_the_agent_reaches_the_adapter_and_nothing_else(
    agent: DockerSandbox, adapter: Adapter, host_listener: int, abstract_socket: str
) -> None:
    done = await agent.run(["python3", "-c", POST, f"http://127.0.0.1:{PORT}/v1/messages"], ENV, timeout=60)
    assert (done.exit_code, done.stdout.strip()) == (0, "adapter:ping"), done.stderr
    [head] = adapter.heads
    assert f"x-rollbus-sandbox: {agent.sandbox_id}".encode() in head and b"someone-else" not in head
    targets = [f"127.0.0.1:{host_listener}", "127.0.0.1:9092", "172.17.0.1:2375", "1.1.1.1:443"]
    targets.append(abstract_socket)
    probed = await agent.run(["python3", "-c", PROBE, *targets], ENV, timeout=60)
    assert probed.stdout.split() == ["ECONNREFUSED", "ECONNREFUSED", "ENETUNREACH", "ENETUNREACH",
                                     "ECONNREFUSED"], probed.stderr  # fmt: skip
    links = await agent.run(["sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1"], ENV)
    assert links.stdout.split() == ["lo"]


async def test_the_grader_has_no_network_at_all(engine: Any, history_image: str, host_listener: int) -> None:
    async with await make(engine, history_image) as box:
        probed = await box.run(["python3", "-c", PROBE, f"127.0.0.1:{host_listener}", "1.1.1.1:443"], ENV)
    assert probed.stdout.split() == ["ECONNREFUSED", "ENETUNREACH"]


async def test_the_agent_is_unprivileged_and_sees_no_engine_nor_host_path(agent: DockerSandbox) -> None:
    script = (
        "id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status | tr -d '\\t';"
        "unshare -U true 2>/dev/null && echo NESTED-USERNS; touch /usr/x 2>/dev/null && echo ROOT-WRITABLE;"
        "ls /var/run/docker.sock /run/docker.sock 2>/dev/null && echo DOCKER-SOCKET;"
        "touch made; cut -d' ' -f5 /proc/self/mountinfo | sort"
    )
    done = await agent.run(["sh", "-c", script], ENV)
    lines = done.stdout.splitlines()
    assert lines[:4] == ["1000", "CapEff:0000000000000000", "CapBnd:0000000000000000", "NoNewPrivs:1"]
    assert not {"NESTED-USERNS", "ROOT-WRITABLE", "DOCKER-SOCKET"} & set(lines), done.stdout
    # the engine's own: three small files it writes, and its init (tini, pid 1) read-only
    engine_made = {"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/sbin/docker-init"}
    engine_made.add("/usr/sbin/docker-init")  # /sbin is a link to usr/sbin in a merged-/usr image
    mounts = {m for m in lines[4:] if not m.startswith(("/proc", "/dev", "/sys"))} - engine_made
    assert mounts == {"/", "/testbed", "/home/agent", "/tmp"}  # nothing of the host's but what is named
    made = agent.layout.disk.free_paths()[0] / "made"  # the workspace's volume, seen through its holder
    assert made.stat().st_uid == 1000  # not host root in disguise


async def test_the_agent_and_the_grader_see_the_base_commit_only(engine: Any, history_image: str) -> None:
    script = (
        "git log --all --oneline | wc -l; git tag | wc -l; git stash list | wc -l; git reflog | wc -l;"
        "git for-each-ref | wc -l; git status --porcelain | wc -l; cat .git/packed-refs 2>/dev/null | wc -l;"
        "for id in $(cat /future.txt); do git cat-file -e $id 2>/dev/null && echo FUTURE; done;"
        "git count-objects -v | awk '/^(count|in-pack):/ {n += $2} END {print n}';"
        "grep -rl FUTURE_FIX_MARKER . | wc -l;"
        "cat build/out; git log --format=%s"
    )
    for options in ({}, {"network": "none"}):
        async with await make(engine, history_image, **options) as box:
            done = await box.run(["sh", "-c", script], ENV)
        # one commit (4 objects: the commit, its tree, two files), no tag, stash, reflog or other ref; the
        # ignored build output copied as the image had it
        assert done.stdout.split() == ["1", "0", "0", "0", "1", "0", "0", "4",
                                       "0", "made", "base"], done.stderr  # fmt: skip


async def test_the_token_is_in_neither_the_engines_record_nor_another_process(agent: DockerSandbox) -> None:
    secret = "rb-" + uuid.uuid4().hex
    # the command (which holds the token, as the CLI would) waits for a sibling command to look everywhere
    hold = asyncio.ensure_future(
        agent.run(["python3", "-c", HOLD], ENV, timeout=60, secret_env={"RB_TOKEN": secret})
    )
    look = (
        "import os, sys; t = sys.argv[1].encode(); found = []\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit() and int(p) != os.getpid():\n"
        "        try: env, cmd = (open(f'/proc/{p}/{f}', 'rb').read() for f in ('environ', 'cmdline'))\n"
        "        except OSError: continue\n"
        "        if t in cmd or (t in env and b'rollbus-holder' not in cmd): found.append(p)\n"
        "print('found', found); open('/tmp/looked', 'w')"
    )
    seen = await agent.run(["python3", "-c", look, secret], ENV, timeout=60)
    held = await hold
    assert seen.stdout.strip() == "found []" and held.exit_code == 0, (seen, held)
    # every container the engine holds, this sandbox's among them; another test's may go between the listing
    # and its inspection (the suite runs on several workers)
    records = [r for c in agent.client.api.containers(all=True) if (r := engine_record(agent.client, c))]
    assert any(agent.sandbox_id in r for r in records) and not any(secret in r for r in records)


HOLD = "import os, time  # rollbus-holder\nwhile not os.path.exists('/tmp/looked'): time.sleep(0.02)"


def engine_record(client: Any, container: dict[str, Any]) -> str:
    """What ``docker inspect`` shows of a container and of each command executed in it ("" once gone)."""
    try:
        info = client.api.inspect_container(container["Id"])
        execs = [client.api.exec_inspect(e) for e in info.get("ExecIDs") or []]
    except docker.errors.NotFound:
        return ""
    return json.dumps([info, execs])


async def test_the_wall_clock_kills_every_process_of_the_command_and_the_sandbox_goes_on(
    agent: DockerSandbox, adapter: Adapter
) -> None:
    """The command tries to take the container down with it (``kill -9 -1`` and a kill of pid 1 and of the
    init's sleep, which hold the sandbox's volumes and network) and to outlive its deadline: every process of
    its own dies at the deadline, the container's do not, and the next command finds its workspace, HOME,
    ``/tmp`` and the adapter's listener as they were."""
    script = (
        "echo kept > kept; echo kept > /home/agent/kept; echo kept > /tmp/kept;"
        "kill -9 -1; for p in /proc/[0-9]*; do [ ${p#/proc/} = $$ ] || kill -9 ${p#/proc/} 2>/dev/null; done;"
        "echo alive;"
        "sleep 60 & sleep 60 & echo started; wait"
    )
    done = await agent.run(["sh", "-c", script], ENV, timeout=3)
    assert done.timed_out and done.failure_kind == "timeout" and done.wall_time_s < 20
    assert "alive" in done.stdout and "started" in done.stdout, done
    assert await processes(agent) == ["sleep infinity"]  # tini's own child, nothing of the command's
    kept = await agent.run(["cat", "kept", "/home/agent/kept", "/tmp/kept"], ENV)
    assert kept.stdout.split() == ["kept", "kept", "kept"], kept
    posted = await agent.run(["python3", "-c", POST, f"http://127.0.0.1:{PORT}/v1/messages"], ENV, timeout=60)
    assert posted.stdout.strip() == "adapter:ping", posted


async def test_a_finished_command_leaves_nothing_running(agent: DockerSandbox) -> None:
    done = await agent.run(["sh", "-c", "sleep 300 > /dev/null 2>&1 & sleep 301 & echo bye"], ENV, timeout=60)
    assert (done.exit_code, done.stdout.strip(), done.timed_out) == (0, "bye", False)
    assert await processes(agent) == ["sleep infinity"]


async def test_where_the_host_cannot_see_the_containers_processes_they_are_killed_from_inside(
    agent: DockerSandbox,
) -> None:
    """A remote engine, or cgroups the runner cannot see (cgroup v2 under Compose): what a command left, and
    what outlived its deadline, die by ``kill -9 -1`` run inside as the commands' uid; the init survives."""
    agent._work_container().cgroups = None
    left = await agent.run(["sh", "-c", "sleep 300 > /dev/null 2>&1 & sleep 301 & echo bye"], ENV, timeout=60)
    late = await agent.run(["sh", "-c", "sleep 60 & echo started; wait"], ENV, timeout=3)
    assert (left.exit_code, left.stdout.strip()) == (0, "bye") and late.failure_kind == "timeout", late
    assert await processes(agent) == ["sleep infinity"]


async def test_commands_as_root_cannot_take_the_sandbox_down(engine: Any, history_image: str) -> None:
    """A row whose user is root: its commands (uid 0, no capability) signal every process they can, and the
    container's init and sleep (another uid) hold on to the workspace for the next command."""
    async with await make(engine, history_image, user="0:0") as box:
        kill = "echo kept > kept; kill -9 -1; for p in /proc/[0-9]*; do kill -9 ${p#/proc/} 2>/dev/null; done"
        await box.run(["sh", "-c", kill], ENV)
        kept = await box.run(["sh", "-c", "id -u; cat kept"], ENV)
    assert kept.stdout.split() == ["0", "kept"], kept


async def processes(box: DockerSandbox) -> list[str]:
    """The command lines of every process in the container but the probe itself and pid 1 (the init)."""
    probe = (
        "import os; me = str(os.getpid())\n"
        "for p in sorted(x for x in os.listdir('/proc') if x.isdigit() and x not in (me, '1')):\n"
        "    try: print(open(f'/proc/{p}/cmdline', 'rb').read().replace(b'\\0', b' ').decode().strip())\n"
        "    except OSError: pass"
    )
    done = await box.run(["python3", "-c", probe], ENV)
    assert done.exit_code == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize(
    ("script", "kind"),
    [
        ("for i in $(seq 200); do sleep 30 & done; wait", "pids_limit"),
        ("python3 -c 'b = bytearray(512 << 20); print(len(b))'", "memory_limit"),
        ("dd if=/dev/zero of=big bs=1M count=64 2>/dev/null; echo wrote", "disk_full"),
        ("dd if=/dev/zero of=/tmp/big bs=1M count=64 2>/dev/null; echo wrote", "disk_full"),
        ("dd if=/dev/zero of=/home/agent/big bs=1M count=64 2>/dev/null; echo wrote", "disk_full"),
    ],
    ids=["pids", "memory", "workspace", "tmp", "home"],
)
async def test_a_limit_hit_is_named_and_the_sandbox_goes_on(
    engine: Any, history_image: str, script: str, kind: str
) -> None:
    async with await make(engine, history_image) as box:
        done = await box.run(["sh", "-c", script], ENV, timeout=60)
        assert done.failure_kind == kind, done
        again = await box.run(["echo", "on"], ENV)
    assert (again.exit_code, again.stdout) == (0, "on\n")


FILL = (
    "for where in /testbed /home/agent; do fallocate -l 64M $where/fill || echo REFUSED;"
    " dd if=/dev/zero of=$where/more bs=1M count=64 2>&1 | grep -c 'No space left';"
    " du -sk $where | cut -f1; done"
)


async def test_the_engine_caps_the_disk_wherever_the_runner_runs(engine: Any, history_image: str) -> None:
    """The agent writes past its disk from inside: each write fails as it is made (ENOSPC), named
    ``disk_full``, and nothing lands on the host. The cap is the engine's (a tmpfs volume of fixed size per
    workspace and HOME), not a mount of the runner's, which a runner in a container beside the engine
    (Compose) could not give it: the host directory behind the sandbox is no mount point and stays empty."""
    async with await make(engine, history_image) as box:
        assert not os.path.ismount(box.host_workdir) and not os.path.ismount(box.layout.home)
        done = await box.run(["sh", "-c", FILL], ENV, timeout=60)
        assert done.failure_kind == "disk_full", done
        refused, ws_full, ws_kib, home_refused, home_full, home_kib = done.stdout.split()
        assert (refused, ws_full, home_refused, home_full) == ("REFUSED", "1", "REFUSED", "1"), done.stdout
        assert int(ws_kib) <= SMALL.disk_bytes >> 10 and int(home_kib) <= SMALL.disk_bytes >> 10
        assert sum(f.stat().st_size for f in box.host_workdir.rglob("*") if f.is_file()) == 0
        container = engine.api.inspect_container(box._work_id)
        volumes = {m["Destination"]: m["Name"] for m in container["Mounts"] if m["Type"] == "volume"}
        assert set(volumes) == {"/testbed", "/home/agent"}
        for name in volumes.values():
            options = engine.api.inspect_volume(name)["Options"]
            assert options["type"] == "tmpfs" and f"size={SMALL.disk_bytes}" in options["o"].split(",")
        # the runner's files come and go through the engine: an agent's link leads nowhere on the host
        with pytest.raises(SandboxError) as full:
            await box.write_file("/home/agent/.config/cli.json", b"{}")
        assert full.value.failure_kind == "disk_full"
        linked = await box.run(["sh", "-c", "rm -f /home/agent/*; ln -s /etc/shadow /home/agent/l"], ENV)
        assert linked.exit_code == 0, linked.stderr
        await box.write_file("/home/agent/.config/cli.json", b"{}")
        assert await box.read_file("/home/agent/.config/cli.json") == b"{}"
        assert await box.read_file("/home/agent/.config/cli.json", limit=1) == b"{"  # no more off the stream
        with pytest.raises(SandboxPathError):
            await box.read_file("/home/agent/l")
        owned = await box.run(["stat", "-c", "%u", "/home/agent/.config/cli.json"], ENV)
        assert owned.stdout.strip() == "1000"
        names = list(volumes.values())
    assert not engine.volumes.list(filters={"label": f"rollbus.sandbox={box.sandbox_id}"})
    assert not [v for v in engine.volumes.list() if v.name in names]  # closed: the disks are gone


async def test_the_agent_clis_run_from_the_cache_in_an_image_that_lacks_them(
    engine: Any, history_image: str
) -> None:
    binds = {str(claude_cli.execute_only_binary()): claude_cli.SANDBOX_BINARY,
             str(codex_cli.execute_only_binary()): codex_cli.SANDBOX_BINARY}  # fmt: skip
    async with await make(engine, history_image, ro_binds=binds) as box:
        claude = await box.run([claude_cli.SANDBOX_BINARY, "--version"], ENV, timeout=120)
        codex = await box.run([codex_cli.SANDBOX_BINARY, "--version"], ENV, timeout=120)
        writable = await box.run(["sh", "-c", f"echo x > {claude_cli.SANDBOX_BINARY} || echo read-only"], ENV)
    assert claude_cli.VERSION in claude.stdout, claude
    assert codex_cli.VERSION in codex.stdout, codex
    assert "read-only" in writable.stdout


async def test_the_patch_is_taken_inside_against_the_trusted_baseline(
    engine: Any, history_image: str
) -> None:
    async with await make(engine, history_image) as box:
        plant = (
            "printf 'def add(a, b):\\n    return a + b\\n' > calc.py; printf '\\377\\000bin' > blob.bin;"
            "echo new > new.txt; git add -A; git -c user.name=a -c user.email=a@b commit -qm 'agent commit';"
            "git config core.fsmonitor 'touch /testbed/PWNED; false'"
        )
        done = await box.run(["sh", "-c", plant], ENV)
        assert done.exit_code == 0, done.stderr
        captured = await box.capture_patch(1 << 20)
        capped = await box.capture_patch(100)
        planted = await box.run(["sh", "-c", "ls PWNED 2>/dev/null | wc -l"], ENV)
    assert captured.failure is None and not captured.truncated, captured
    assert b"+    return a + b" in captured.patch and b"new.txt" in captured.patch
    assert b"GIT binary patch" in captured.patch  # bytes, never text
    assert capped.truncated and len(capped.patch) == 100
    assert planted.stdout.split() == ["0"]  # the agent's git config ran nothing


async def test_a_missing_image_is_an_image_error(engine: Any) -> None:
    with pytest.raises(SandboxError) as raised:
        await make(engine, "rollbus-test/absent:never")
    assert raised.value.failure_kind == "image_error"


async def test_a_path_rows_tree_runs_in_an_image_of_it_built_once_with_its_history_scrubbed(
    engine: Any, tmp_path: Path
) -> None:
    """A row whose image is a host repository (the swe-mini rows) runs on the docker backend in the base
    image with the tree at its workdir, tagged by content (built once); the fix on a later branch stays
    unseen; a path that is no directory is an image error."""
    from rollbus.sandbox.spec import SandboxSpec, create_sandbox

    tree = tmp_path / "Calc Repo"
    tree.mkdir()
    git = ["git", "-C", str(tree), "-c", "user.name=a", "-c", "user.email=a@b"]
    (tree / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    for argv in (
        ["init", "-q", "-b", "main"],
        ["add", "."],
        ["commit", "-qm", "base"],
        ["checkout", "-qb", "fix"],
    ):
        await asyncio.to_thread(subprocess_run, [*git, *argv])
    (tree / "calc.py").write_text("def add(a, b):\n    return a + b  # FIX_MARKER\n")
    for argv in (["commit", "-qam", "fix"], ["checkout", "-q", "main"]):
        await asyncio.to_thread(subprocess_run, [*git, *argv])
    spec = SandboxSpec(
        image=tree, role="grader", workdir="/testbed", limits=SMALL, sandbox_id=uuid.uuid4().hex[:12]
    )
    async with await create_sandbox(spec, "docker", client=engine, scratch_root=tmp_path) as box:
        done = await box.run(
            ["sh", "-c", "cat calc.py; git log --all --format=%s; grep -rl FIX_MARKER . | wc -l"], ENV
        )
        image = engine.images.get(box.image_digest)
    assert done.stdout.split() == ["def", "add(a,", "b):", "return", "a", "-", "b", "base", "0"], done.stderr
    tag = next(t for t in image.tags if t.startswith(f"{docker_images.TREE_REPOSITORY}/calc-repo:"))
    assert docker_images.ensure_tree_image(engine, tree, "/testbed") == tag  # cached: the same tag, no build
    with pytest.raises(SandboxError) as raised:
        bad = SandboxSpec(image=tmp_path / "absent", role="grader", sandbox_id=uuid.uuid4().hex[:12])
        await create_sandbox(bad, "docker", client=engine, scratch_root=tmp_path)
    assert raised.value.failure_kind == "image_error"


def subprocess_run(argv: list[str]) -> None:
    import subprocess

    subprocess.run(argv, check=True, capture_output=True)


def test_the_base_image_is_built_once_and_answers_to_its_public_name(engine: Any) -> None:
    base = docker_images.BASE
    before = engine.images.get(base.tag).id
    assert docker_images.ensure_base_image(engine) == base.tag  # cached: nothing built
    assert engine.images.get(base.tag).id == before and engine.images.get("debian:bookworm").id == before


def test_where_no_engine_answers_the_tests_run_on_the_projects_own(engine: Any) -> None:
    """CI has no engine of its own: the session's came from ``docker_engine.client()`` starting one under
    the cache (its data there), and a second call finds it rather than starting another."""
    if os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").is_socket():
        assert engine.ping()
        return
    pid = int((docker_engine.engine_dir() / "dockerd.pid").read_text())
    again = docker_engine.client()
    assert again.info()["DockerRootDir"] == str(docker_engine.engine_dir() / "data")
    assert int((docker_engine.engine_dir() / "dockerd.pid").read_text()) == pid
    again.close()


def test_an_engine_that_cannot_start_says_why_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLBUS_CACHE", "/tmp/" + "x" * 120)
    with pytest.raises(docker_engine.EngineUnavailable) as raised:
        docker_engine.start_engine()
    assert "longer than 107 bytes" in str(raised.value) and "\n" not in str(raised.value)
    assert not Path("/tmp/" + "x" * 120).exists()  # nothing made


def test_a_socket_left_by_a_dead_engine_is_nobody_answering_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a machine's processes were ended (CI's does so between a session and its run) the engine's
    socket file stays behind; the client must see no engine there (and start one), not raise the SDK's
    error from asking a dead socket for its API version."""
    cache = tmp_path / "c"
    (cache / "docker").mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(cache / "docker" / "docker.sock"))
    stale.close()  # the file stays; nobody listens
    monkeypatch.setenv("ROLLBUS_CACHE", str(cache))
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    if Path("/var/run/docker.sock").is_socket():
        pytest.fail("this machine's default socket would answer for the engine; run where none does")
    with pytest.raises(docker_engine.EngineUnavailable, match="no Docker engine answers"):
        docker_engine.client(start=False)


KILLED_RUNNER = """
import asyncio, os, sys
from pathlib import Path
from rollbus.sandbox.docker_backend import DockerSandbox
async def main():
    box = await DockerSandbox.create(sys.argv[1], workdir="/testbed", scratch_root=Path(sys.argv[2]))
    await box.run(["true"], {"PATH": "/usr/bin:/bin"})
    print(box.sandbox_id, flush=True)
    os.kill(os.getpid(), 9)
asyncio.run(main())
"""


async def test_what_a_killed_runner_left_is_swept(engine: Any, history_image: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    from rollbus.sandbox import docker_backend

    done = subprocess.run([sys.executable, "-c", KILLED_RUNNER, history_image, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    sandbox_id = done.stdout.strip()
    assert done.returncode == -9 and sandbox_id, done.stderr
    left = engine.containers.list(filters={"label": f"rollbus.sandbox={sandbox_id}"})
    assert left and (tmp_path / f"{sandbox_id}.docker").is_dir()  # its command container runs on
    async with await make(engine, history_image, scratch_root=tmp_path) as alive:
        assert sandbox_id in docker_backend.sweep_stale(engine, tmp_path)
        assert not engine.containers.list(all=True, filters={"label": f"rollbus.sandbox={sandbox_id}"})
        assert not (tmp_path / f"{sandbox_id}.docker").exists()
        assert not engine.volumes.list(filters={"label": f"rollbus.sandbox={sandbox_id}"})  # its capped disks
        assert (await alive.run(["true"], ENV)).exit_code == 0  # a live runner's sandbox is not touched


def test_an_images_tree_is_exported_to_the_host_as_it_is(
    engine: Any, history_image: str, tmp_path: Path
) -> None:
    """What host-side grading of a container image's row starts from: the image's repository, history and
    all (the grader re-makes its one-commit tree from it), nothing of the image run."""
    tree = docker_images.export_tree(engine, history_image, "/testbed", tmp_path / "tree")
    assert (tree / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"
    assert (tree / ".git" / "HEAD").is_file() and (tree / "build" / "out").read_text() == "made\n"
    with pytest.raises(docker_images.ImageBuildError):
        docker_images.export_tree(engine, "rollbus-test/absent:never", "/testbed", tmp_path / "none")


ATTRIBUTED = (
    "import subprocess, sys, urllib.request as u\n"
    "def post(): return u.urlopen(u.Request(sys.argv[1], data=b'x', headers={'X-Rollbus-Peer': 'agent'}),"
    " timeout=10).read()\n"
    "post()  # the agent's own request\n"
    "subprocess.run([sys.executable, '-c', 'import urllib.request as u, sys; u.urlopen(u.Request(sys.argv[1],"
    ' data=b"y", headers={"X-Rollbus-Peer": "agent"}), timeout=10).read()\', sys.argv[1]], check=True)'
)


async def test_only_the_agents_own_process_is_stamped_agent(agent: DockerSandbox, adapter: Adapter) -> None:
    """The proxy knows the command's process from the host's /proc: its own request is the agent's; its
    child's (a tool), with a forged header, is a tool's."""
    url = f"http://127.0.0.1:{PORT}/v1/messages"
    done = await agent.run(["python3", "-c", ATTRIBUTED, url], ENV, timeout=60, agent=True)
    assert done.exit_code == 0, done.stderr
    peers = [h.split(b"x-rollbus-peer: ", 1)[1].split(b"\r\n", 1)[0] for h in adapter.heads]
    assert peers == [b"agent", b"tool"]
    assert agent.proxy is not None and agent.proxy.agent is None  # the run is over: nothing is the agent


async def test_descriptors_are_refused_by_name(agent: DockerSandbox) -> None:
    """The grader's channel (descriptors bwrap's commands inherit) cannot cross the Engine API: refused."""
    with pytest.raises(SandboxError, match="pass_fds"):
        await agent.run(["true"], ENV, pass_fds=(0,))


async def test_cpu_time_and_output_limits_are_named(engine: Any, history_image: str) -> None:
    limits = Limits(memory_bytes=128 << 20, pids=64, cpu_time_s=1, output_bytes=4096)
    async with await make(engine, history_image, limits=limits) as box:
        spin = await box.run(["python3", "-c", "while True: pass"], ENV, timeout=60)
        loud = await box.run(["python3", "-c", "print('x' * 100_000)"], ENV, timeout=60)
    assert spin.failure_kind == "cpu_limit" and spin.wall_time_s < 30, spin
    assert loud.failure_kind == "output_truncated" and loud.output_dropped > 90_000
    assert len(loud.stdout) < 4096 + 100


async def test_another_rollouts_requests_processes_token_and_files_are_out_of_reach(
    engine: Any, history_image: str, adapter: Adapter
) -> None:
    """Two live agents on the same port: each request arrives stamped with its own sandbox's id; the first,
    while the second holds a token in its environment and a file in its workspace, finds neither, sees only
    its own few processes, and cannot reconfigure its network (no capability, the engine's namespace)."""
    url = f"http://127.0.0.1:{PORT}/v1/messages"
    options = {"network": "adapter", "adapter_url": adapter.url, "forward_port": PORT}
    async with (
        await make(engine, history_image, **options) as first,
        await make(engine, history_image, **options) as second,
    ):
        token = f"sk-rollout-{uuid.uuid4().hex}"
        await second.write_file(f"{second.workdir}/secret.txt", f"other rollout {token}")
        hold = "import os, time\nopen('started', 'w')\nwhile not os.path.exists('release'): time.sleep(0.02)"
        victim = asyncio.ensure_future(
            second.run(["python3", "-c", hold], {**ENV, "ANTHROPIC_AUTH_TOKEN": token}, timeout=60)
        )
        async def started() -> bool:  # read through the engine: the workspace is the sandbox's volume
            try:
                return await second.read_file(f"{second.workdir}/started") == b""
            except FileNotFoundError:
                return False

        while not await started() and not victim.done():
            await asyncio.sleep(0.05)  # the victim's process runs (or ended): now look for it
        spy = (
            f"grep -ls {token} /proc/*/environ; grep -rsl {token} / --exclude-dir=proc --exclude-dir=sys"
            " --exclude-dir=usr; ls /proc | grep -c '^[0-9]';"
            "python3 -c 'import fcntl, socket, struct; s = socket.socket(); fcntl.ioctl(s, 0x8914,"
            ' struct.pack("16sH", b"lo", 0) + bytes(22))\' 2>&1 | tail -1'
        )
        seen = await first.run(["sh", "-c", spy], ENV, timeout=120)
        await second.write_file(f"{second.workdir}/release", "")
        held = await victim
        replies = await asyncio.gather(
            *(box.run(["python3", "-c", POST, url], ENV, timeout=60) for box in (first, second))
        )
        ids = {first.sandbox_id, second.sandbox_id}
    assert held.exit_code == 0, held.stderr
    lines = seen.stdout.splitlines()
    assert int(lines[0]) <= 8, seen.stdout  # its own pid namespace: tini, its sleep, the probe
    assert lines[1:] == ["PermissionError: [Errno 1] Operation not permitted"], seen.stdout  # lo stays up
    assert [r.stdout.strip() for r in replies] == ["adapter:ping", "adapter:ping"]
    stamped = {h.split(b"x-rollbus-sandbox: ")[1].split(b"\r\n")[0].decode() for h in adapter.heads}
    assert stamped == ids and len(adapter.heads) == 2


async def test_the_cached_workspace_is_copied_never_shared(engine: Any, history_image: str) -> None:
    """The scrubbed workspace is made once per image and copied into each sandbox: what one agent writes
    (a tracked file, its repository's config and a new object) never reaches the next sandbox of the image,
    whose patch is taken against a baseline of its own."""
    tamper = (
        "echo 'def add(a, b): return 0' > calc.py && git config core.hooksPath /tmp && git add calc.py &&"
        " echo planted > .git/planted"
    )
    async with await make(engine, history_image) as first:
        done = await first.run(["sh", "-c", tamper], ENV)
        assert done.exit_code == 0, done.stderr
    async with await make(engine, history_image) as second:
        seen = await second.run(
            ["sh", "-c", "cat calc.py; git config core.hooksPath; ls .git/planted; git status --short"], ENV
        )
        captured = await second.capture_patch(1 << 20)
    assert seen.stdout == "def add(a, b):\n    return a - b\n", seen
    assert (captured.failure, captured.patch) == (None, b""), captured
