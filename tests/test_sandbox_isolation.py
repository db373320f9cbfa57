"""The agent and grader sandboxes, attacked from inside as a policy would: real bwrap, real git.

Every probe runs inside a sandbox made by :func:`create_local` the way the runner makes it (adapter network,
limits on) and reports what the kernel answered; a refusal must come from the sandbox's own network
namespace (ECONNREFUSED on its loopback, ENETUNREACH for any other address), never from a host firewall.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import struct
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollbus.sandbox import SandboxSpec, bwrap_usable, create_local, git_diff
from rollbus.sandbox.bwrap import BwrapSandbox

EXAMPLE_REPO = Path(__file__).resolve().parents[1] / "examples" / "buggy_repo"
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/home/agent"}
BASE_URL = "http://127.0.0.1:4000"

pytestmark = pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")

# Prints the errno name of a TCP (or abstract unix) connect from inside: OK, ECONNREFUSED, ENETUNREACH...
PROBE = """
import errno, socket, sys
def probe(target):
    try:
        if target.startswith("@"):
            s = socket.socket(socket.AF_UNIX); s.settimeout(3); s.connect("\\0" + target[1:])
        else:
            host, port = target.rsplit(":", 1)
            s = socket.create_connection((host, int(port)), timeout=3)
        return "OK"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc))
print(" ".join(probe(t) for t in sys.argv[1:]))
"""


class Adapter:
    """A stand-in adapter on host loopback that answers every request and keeps its heads."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            self.heads.append(head)
            length = next(
                (
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length:")
                ),
                0,
            )
            body = await reader.readexactly(length)
            reply = b"adapter:" + body
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(reply), reply))
            await writer.drain()
        writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def adapter() -> AsyncIterator[Adapter]:
    fake = Adapter()
    fake.server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    yield fake
    fake.server.close()


@pytest.fixture
async def agent(adapter: Adapter) -> AsyncIterator[BwrapSandbox]:
    spec = SandboxSpec(image=EXAMPLE_REPO, adapter_url=adapter.url, base_url=BASE_URL)
    async with await create_local(spec) as box:
        yield box


@pytest.fixture
async def grader() -> AsyncIterator[BwrapSandbox]:
    async with await create_local(SandboxSpec(image=EXAMPLE_REPO, role="grader")) as box:
        yield box


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


async def probe(box: BwrapSandbox, *targets: str) -> list[str]:
    done = await box.run(["python3", "-c", PROBE, *targets], ENV, timeout=60)
    assert done.exit_code == 0, done.stderr
    return done.stdout.split()


def host_nameserver() -> str:
    for line in Path("/etc/resolv.conf").read_text().splitlines():
        if line.startswith("nameserver"):
            return line.split()[1]
    return "10.255.255.53"


CURL = ["curl", "-s", "-H", "X-Rollbus-Sandbox: someone-else", "-d", "ping", f"{BASE_URL}/v1/messages"]


async def test_the_agent_reaches_the_adapter_through_its_socket_stamped_with_its_id(
    agent: BwrapSandbox, adapter: Adapter
) -> None:
    done = await agent.run(CURL, ENV, timeout=60)
    assert (done.exit_code, done.stdout) == (0, "adapter:ping")
    [head] = adapter.heads
    assert f"x-rollbus-sandbox: {agent.sandbox_id}".encode() in head
    assert b"someone-else" not in head  # the agent cannot claim another rollout
    assert agent.enforced["network"] == "own namespace, the adapter proxy listens inside"
    done = await agent.run(CURL, ENV, timeout=60)  # the listener outlives a command: a second one works
    assert done.stdout == "adapter:ping" and len(adapter.heads) == 2


async def test_without_a_namespace_of_its_own_socat_forwards_to_the_adapter_socket(
    adapter: Adapter, tmp_path: Path, host_listener: int
) -> None:
    """What a host without root gets (forced here): a forwarder inside, the proxy's socket bind-mounted."""
    from rollbus.sandbox import AdapterProxy, prepare_repo

    socket_path = tmp_path / "adapter.sock"
    box = await BwrapSandbox.create(
        prepare_repo(EXAMPLE_REPO, tmp_path / "repo"),
        network="adapter",
        adapter_socket=socket_path,
        forward_port=4000,
    )
    proxy = await AdapterProxy(socket_path, adapter.url, box.sandbox_id, owner=box.host_uid).start()
    try:
        done = await box.run(CURL, ENV, timeout=60)
        refused = await probe(box, f"127.0.0.1:{host_listener}", "1.1.1.1:443")
    finally:
        await box.close()
        await proxy.close()
    assert (done.exit_code, done.stdout) == (0, "adapter:ping"), done.stderr
    assert f"x-rollbus-sandbox: {box.sandbox_id}".encode() in adapter.heads[0]
    assert refused == ["ECONNREFUSED", "ENETUNREACH"]
    assert box.enforced["network"] == "own namespace, socat to the adapter socket"


async def test_nothing_but_the_adapter_is_reachable_from_the_agent(
    agent: BwrapSandbox, host_listener: int, abstract_socket: str
) -> None:
    """The test's own listener stands for the broker and the engine: any host port is refused alike."""
    targets = [
        f"127.0.0.1:{host_listener}",  # a host loopback listener (broker, engine, anything)
        "127.0.0.1:9092",  # Kafka's default port
        f"{host_nameserver()}:53",  # the host's resolver
        "1.1.1.1:443",  # outside
        abstract_socket,  # a host abstract unix socket
    ]
    assert await probe(agent, *targets) == [
        "ECONNREFUSED",
        "ECONNREFUSED",
        "ENETUNREACH",
        "ENETUNREACH",
        "ECONNREFUSED",
    ]
    done = await agent.run(["sh", "-c", "tail -n +3 /proc/net/dev | cut -d: -f1; cat /etc/resolv.conf"], ENV)
    assert done.stdout.split() == ["lo"]  # its own namespace: loopback only, no resolver configured


async def test_the_broker_is_unreachable_from_the_agent(agent: BwrapSandbox, kafka_bootstrap: str) -> None:
    host, port = kafka_bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5):
        pass  # the control: the broker is up and reachable from the host
    assert await probe(agent, f"127.0.0.1:{port}") == ["ECONNREFUSED"]


async def test_the_grader_has_no_network_at_all(grader: BwrapSandbox, host_listener: int) -> None:
    assert await probe(grader, f"127.0.0.1:{host_listener}", "1.1.1.1:443") == ["ECONNREFUSED", "ENETUNREACH"]
    done = await grader.run(["sh", "-c", "ls /run; tail -n +3 /proc/net/dev | cut -d: -f1"], ENV)
    assert done.stdout.split() == ["lo"]  # no adapter socket either


async def test_eval_files_other_sandboxes_and_host_files_are_invisible(
    adapter: Adapter, tmp_path: Path
) -> None:
    hidden = tmp_path / "eval" / "hidden_test.py"
    hidden.parent.mkdir()
    hidden.write_text("GOLD = 42\n")
    spec = SandboxSpec(image=EXAMPLE_REPO, adapter_url=adapter.url, base_url=BASE_URL)
    async with await create_local(spec) as first, await create_local(spec) as second:
        await second.write_file(f"{second.workdir}/secret.txt", "other rollout")
        paths = [
            str(hidden),
            str(second.host_workdir / "secret.txt"),
            str(second.host_workdir),
            "/root",
            "/work",
            "/tmp/rollbus-sandboxes",
            "/proc/1/root/etc/hostname",
            "/etc/shadow",
        ]
        script = "for p in " + " ".join(paths) + "; do ls $p >/dev/null 2>&1 && echo SEEN $p; done; true"
        done = await first.run(["sh", "-c", script], ENV)
        grep_all = "grep -rs 'other rollout\\|GOLD = 42' / --exclude-dir=proc --exclude-dir=usr"
        grep = await first.run(["sh", "-c", grep_all], ENV, timeout=120)
        control = await first.run(["ls", "/workspace/calc.py", "/home/agent"], ENV)
    assert done.stdout == ""
    assert grep.stdout == ""
    assert control.exit_code == 0  # the probe does see what is meant to be there


def image_with_future(tmp_path: Path) -> tuple[Path, str]:
    """A repository checked out at its base, holding a later fix commit, a tag, a branch and a stash."""
    repo = tmp_path / "image"
    subprocess.run(["cp", "-a", str(EXAMPLE_REPO), str(repo)], check=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]

    def run(*args: str) -> str:
        return subprocess.run(
            [*git, *args], cwd=repo, check=True, capture_output=True, text=True
        ).stdout.strip()

    run("init", "-q")
    run("add", "-A")
    run("commit", "-qm", "base")
    run("checkout", "-qb", "fix")
    (repo / "calc.py").write_text((repo / "calc.py").read_text() + "\nFUTURE_FIX_MARKER = 1\n")
    run("commit", "-qam", "the fix")
    future = run("rev-parse", "HEAD")
    run("tag", "v-fix")
    run("checkout", "-q", "main")
    (repo / "README.md").write_text("stashed work\n")
    run("stash")
    run("gc", "-q")  # pack everything, future included
    return repo, future


async def test_the_agent_sees_the_base_commit_only(tmp_path: Path) -> None:
    image, future = image_with_future(tmp_path)
    async with await create_local(SandboxSpec(image=image)) as box:
        script = (
            "git log --all --oneline | wc -l; git tag | wc -l; git stash list | wc -l; git reflog | wc -l;"
            "git for-each-ref | wc -l; find .git -name '*.pack' | wc -l; git status --porcelain | wc -l;"
            f"git cat-file -e {future} 2>/dev/null && echo FUTURE; grep -rl FUTURE_FIX_MARKER . | wc -l"
        )
        done = await box.run(["sh", "-c", script], ENV)
        assert done.stdout.split() == ["1", "0", "0", "0", "1", "0", "0", "0"], done.stderr
    async with await create_local(SandboxSpec(image=image, role="grader")) as box:
        done = await box.run(["git", "cat-file", "-t", future], ENV)
        assert done.stdout.strip() == "commit"  # the grader works from the full image


async def test_the_agent_is_not_root_in_disguise(agent: BwrapSandbox) -> None:
    script = (
        "touch made; cp /bin/true suid; chmod 4755 suid; id -u;"
        "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status | tr -d '\\t';"
        "unshare -U true 2>/dev/null && echo NESTED-USERNS; unshare -Ur true 2>/dev/null && echo NESTED-ROOT;"
        "grep -E ' (/workspace|/tmp|/home/agent) ' /proc/self/mounts | cut -d' ' -f2,4"
    )
    done = await agent.run(["sh", "-c", script], ENV)
    lines = done.stdout.splitlines()
    assert lines[:4] == ["1000", "CapEff:0000000000000000", "CapBnd:0000000000000000", "NoNewPrivs:1"]
    assert "NESTED" not in done.stdout
    mounts = dict(line.split(" ", 1) for line in lines[4:])
    assert set(mounts) == {"/workspace", "/tmp", "/home/agent"}
    assert all({"nosuid", "nodev"} <= set(opts.split(",")) for opts in mounts.values())
    made = (agent.host_workdir / "made").stat()
    assert made.st_uid not in (0, os.getuid()) and made.st_uid == agent.host_uid
    suid = (agent.host_workdir / "suid").stat()
    assert suid.st_uid == agent.host_uid and not suid.st_mode & (stat.S_ISUID | stat.S_ISGID)  # stripped
    assert "new file mode 100755" in git_diff(agent.host_workdir)  # and a patch carries no setuid bit


async def test_write_file_hands_files_to_the_agent(agent: BwrapSandbox) -> None:
    await agent.write_file(f"{agent.workdir}/new/dir/f.txt", "x")
    done = await agent.run(["sh", "-c", "echo y >> new/dir/f.txt && touch new/dir/g"], ENV)
    assert done.exit_code == 0, done.stderr


async def test_enforced_limits_are_reported(agent: BwrapSandbox) -> None:
    report = json.dumps(agent.enforced)
    assert agent.enforced["nested_userns"] == "bwrap --disable-userns"
    assert "NOT" not in report and agent.enforced["identity"].startswith("host uid")


async def test_the_real_cli_works_through_the_forwarder_and_nothing_else() -> None:
    """The real CLI, with the adapter socket as its only way out, fixes the repo; each request is stamped."""
    from rollbus import claude_cli
    from tests.fake_anthropic import FakeAnthropic
    from tests.test_claude_cli_e2e import MODEL, TOKEN, scripted_replies

    binary = claude_cli.fetch()
    async with FakeAnthropic(scripted_replies()) as server:
        spec = SandboxSpec(
            image=EXAMPLE_REPO,
            adapter_url=server.url,
            base_url=BASE_URL,
            ro_binds={str(binary): claude_cli.SANDBOX_BINARY},
        )
        async with await create_local(spec) as box:
            cmd = claude_cli.build_command(
                "Make the tests in /workspace pass.",
                model=MODEL,
                max_turns=6,
                binary=claude_cli.SANDBOX_BINARY,
            )
            env = claude_cli.build_env(BASE_URL, TOKEN, model=MODEL, home=box.home)
            episode = await box.run(cmd, env, timeout=300)
            assert episode.exit_code == 0, episode.stderr
            assert "range(1, n + 1)" in (box.host_workdir / "calc.py").read_text()
            calls = server.message_requests()
            assert calls and all(c.headers["x-rollbus-sandbox"] == box.sandbox_id for c in calls)


async def test_each_agent_reaches_only_its_own_listener_and_cannot_reconfigure_its_network(
    adapter: Adapter,
) -> None:
    """Two live agents on the same port: each request arrives stamped with its own sandbox's id. The agent's
    namespace belongs to the host: taking loopback down, adding an address or a route is refused."""
    spec = SandboxSpec(image=EXAMPLE_REPO, adapter_url=adapter.url, base_url=BASE_URL)
    tamper = (
        "ip link set lo down 2>&1; ip addr add 10.9.9.9/24 dev lo 2>&1; ip route add default dev lo 2>&1;"
        "ip link add dummy0 type dummy 2>&1; true"
    )
    async with await create_local(spec) as first, await create_local(spec) as second:
        tampered = await first.run(["sh", "-c", tamper], ENV)
        replies = await asyncio.gather(first.run(CURL, ENV, timeout=60), second.run(CURL, ENV, timeout=60))
        ids = {first.sandbox_id, second.sandbox_id}
    assert tampered.stdout.count("Operation not permitted") == 4, tampered.stdout
    assert [r.stdout for r in replies] == ["adapter:ping", "adapter:ping"]
    stamped = {h.split(b"x-rollbus-sandbox: ")[1].split(b"\r\n")[0].decode() for h in adapter.heads}
    assert stamped == ids and len(adapter.heads) == 2


async def test_another_rollouts_processes_and_token_are_invisible(adapter: Adapter) -> None:
    spec = SandboxSpec(image=EXAMPLE_REPO, adapter_url=adapter.url, base_url=BASE_URL)
    async with await create_local(spec) as first, await create_local(spec) as second:
        token = f"sk-rollout-{uuid.uuid4().hex}"
        victim = asyncio.ensure_future(second.run(["sleep", "5"], {**ENV, "ANTHROPIC_AUTH_TOKEN": token}))
        await asyncio.sleep(1.0)
        spy = await first.run(
            ["sh", "-c", f"grep -ls {token} /proc/*/environ; ls /proc | grep -c '^[0-9]'"], ENV
        )
        victim.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await victim
    assert token not in spy.stdout
    assert int(spy.stdout.split()[-1]) <= 8  # its own pid namespace: a handful of its own processes only


@pytest.mark.parametrize("guard", ["auto", "seccomp"])
async def test_nested_user_namespaces_fail_with_either_guard(guard: str, tmp_path: Path) -> None:
    """``--disable-userns`` here; the seccomp filter is what a bwrap without it gets (forced here)."""
    from rollbus.sandbox import prepare_repo

    repo = prepare_repo(EXAMPLE_REPO, tmp_path / "repo")
    box = await BwrapSandbox.create(repo, userns_guard=guard)  # type: ignore[arg-type]
    script = (
        "unshare -U true 2>&1; echo rc=$?; unshare -Ur id -u 2>&1; echo rc=$?;"
        'python3 -c \'import os, threading; t = threading.Thread(target=print, args=("thread",)); t.start();'
        ' t.join(); pid = os.fork(); os._exit(0) if pid == 0 else print("fork", os.waitpid(pid, 0)[1])\''
    )
    done = await box.run(["sh", "-c", script], ENV)
    await box.close()
    assert done.stdout.count("rc=1") == 2 and "rc=0" not in done.stdout, done.stdout
    assert "thread\nfork 0" in done.stdout  # threads (clone3 -> clone fallback) and fork still work
    assert box.enforced["nested_userns"] == (
        "bwrap --disable-userns" if guard == "auto" else "seccomp filter"
    )


def test_the_seccomp_program_is_well_formed() -> None:
    from rollbus.sandbox.seccomp import nested_userns_filter

    assert nested_userns_filter("sparc") is None  # unknown machines get no filter, and the report says so
    for machine in ("x86_64", "aarch64"):
        program = nested_userns_filter(machine)
        assert program is not None and len(program) % 8 == 0
        count = len(program) // 8
        for i in range(count):  # every jump lands inside the program
            code, jt, jf, _ = struct.unpack_from("<HBBI", program, 8 * i)
            if code & 0x07 == 0x05:
                assert i + 1 + max(jt, jf) < count
        assert struct.unpack_from("<HBBI", program, 8 * (count - 1))[0] == 0x06  # ends in a return
