"""Which process sent a request, as an attacker inside the agent sandbox would try to blur it: real bwrap.

The agent here is a stand-in for the CLI: an execute-only copy of bash (what the runner does to the CLI's
binary), run as the sandbox's agent command. It talks to the adapter itself over ``/dev/tcp`` and starts the
tools a policy would: ``curl`` and ``python3`` children that forge ``X-Rollbus-Peer: agent``, a child that
writes on the agent's own socket, a child that reads the agent's memory and environment. The real CLI does the
same from its Bash tool at the end. Each request's stamp is read from what the stand-in adapter received.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rollbus.sandbox import AdapterProxy, SandboxSpec, bwrap_usable, create_local, prepare_repo
from rollbus.sandbox.adapter_proxy import stamp_head
from rollbus.sandbox.bwrap import BwrapSandbox
from rollbus.sandbox.peer import (
    AgentProcess,
    _tables,
    attribute,
    client_inode,
    decode_address,
    tcp_rows,
    verdict,
)
from tests.test_sandbox_isolation import BASE_URL, ENV, EXAMPLE_REPO, Adapter

STANDIN = "/opt/standin/bash"
PORT = BASE_URL.rsplit(":", 1)[1]
# One request on fd 3 (forging the peer header, as everything here does), then exactly its reply read back.
REQUEST = (
    "POST %s HTTP/1.1\\r\\nhost: sandbox\\r\\nX-Rollbus-Peer: agent\\r\\ncontent-length: 2\\r\\n\\r\\nhi"
)
REPLY_BYTES = len(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nadapter:hi")
SEND = f'printf "{REQUEST}" "$1" >&3 && read -r -N {REPLY_BYTES} -t 20 reply <&3 && echo "$1 ${{reply: -2}}"'
PY_REQUEST = (
    f"import socket, sys; s = socket.create_connection(('127.0.0.1', {PORT}));"
    "s.sendall(b'POST /python HTTP/1.1\\r\\nx-rollbus-peer: agent\\r\\ncontent-length: 2\\r\\n\\r\\nhi');"
    "print('/python', s.recv(4096)[-2:].decode())"
)
# The agent: its own request, then tools, then its own socket shared with a child, then alone again.
AGENT_SCRIPT = f"""
send() {{ {SEND}; }}
exec 3<>/dev/tcp/127.0.0.1/{PORT}
send /agent
curl -s -H 'X-Rollbus-Peer: agent' -H 'x-rollbus-peer:agent' -d hi {BASE_URL}/curl; echo
python3 -c "{PY_REQUEST}"
bash -c '{SEND}' child /shared
send /agent-again
"""
pytestmark = pytest.mark.skipif(not bwrap_usable(), reason="bubblewrap cannot create namespaces here")


def peers(adapter: Adapter) -> dict[str, list[str]]:
    """request path -> the x-rollbus-peer values the adapter received with it (one, if the proxy is right)."""
    seen: dict[str, list[str]] = {}
    for head in adapter.heads:
        lines = head.decode().split("\r\n")
        values = [
            v.strip() for n, _, v in (h.partition(":") for h in lines[1:]) if n.lower() == "x-rollbus-peer"
        ]
        seen[lines[0].split()[1]] = values
    return seen


def standin(directory: Path, mode: int) -> Path:
    """A copy of the host's bash with ``mode`` (0o111: execute-only, as the runner makes the CLI's binary)."""
    directory.mkdir()
    copy = directory / "bash"
    shutil.copyfile(shutil.which("bash") or "/bin/bash", copy)
    copy.chmod(mode)
    return directory


@pytest.fixture
async def adapter() -> AsyncIterator[Adapter]:
    fake = Adapter()
    fake.server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    yield fake
    fake.server.close()


async def agent_box(adapter: Adapter, tmp_path: Path, mode: int = 0o111) -> BwrapSandbox:
    binds = {str(standin(tmp_path / "standin", mode)): "/opt/standin"}
    spec = SandboxSpec(image=EXAMPLE_REPO, adapter_url=adapter.url, base_url=BASE_URL, ro_binds=binds)
    return await create_local(spec)


async def test_only_the_agent_process_itself_is_stamped_agent(adapter: Adapter, tmp_path: Path) -> None:
    async with await agent_box(adapter, tmp_path) as box:
        done = await box.run([STANDIN, "-c", AGENT_SCRIPT], ENV, timeout=60, agent=True)
    assert done.exit_code == 0, done.stderr
    assert done.stdout.split() == [
        "/agent",
        "hi",
        "adapter:hi",
        "/python",
        "hi",
        "/shared",
        "hi",
        "/agent-again",
        "hi",
    ]
    assert peers(adapter) == {
        "/agent": ["agent"],  # the agent's own socket, held by it alone
        "/curl": ["tool"],  # a tool's request, its forged header (sent twice) replaced by one stamp
        "/python": ["tool"],
        "/shared": ["tool"],  # written by a child on the agent's own socket: two processes hold it
        "/agent-again": ["agent"],  # the same socket once the child is gone
    }
    assert box.enforced["attribution"] == "the agent's process, from the host's /proc"


async def test_without_an_agent_run_every_request_is_a_tools(adapter: Adapter, tmp_path: Path) -> None:
    """The same script run as an ordinary command (a probe, a debugging shell): the proxy knows no agent."""
    async with await agent_box(adapter, tmp_path) as box:
        done = await box.run([STANDIN, "-c", AGENT_SCRIPT], ENV, timeout=60)
    assert done.exit_code == 0, done.stderr
    assert peers(adapter) == dict.fromkeys(
        ["/agent", "/curl", "/python", "/shared", "/agent-again"], ["tool"]
    )


# A tool's attempts on its parent, the agent: each line names what the kernel allowed.
SPY = r"""
import ctypes, os, sys
agent = int(sys.argv[1])
def attempt(name, action):
    try:
        action()
        print(name, "ALLOWED")
    except OSError as exc:
        print(name, "denied", exc.errno)
attempt("environ", lambda: open(f"/proc/{agent}/environ", "rb").read())
attempt("mem", lambda: open(f"/proc/{agent}/mem", "rb"))
attempt("fd", lambda: os.listdir(f"/proc/{agent}/fd"))
libc = ctypes.CDLL(None, use_errno=True)
def ptrace():  # PTRACE_SEIZE: no stop; the tracee is let go when this process exits
    if libc.ptrace(0x4206, agent, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "ptrace")
attempt("ptrace", ptrace)
def getfd():
    pidfd = os.pidfd_open(agent)
    if libc.syscall(438, pidfd, 3, 0) < 0:  # pidfd_getfd(pidfd, 3, 0): the agent's socket
        raise OSError(ctypes.get_errno(), "pidfd_getfd")
attempt("pidfd_getfd", getfd)
"""


@pytest.mark.parametrize("mode", [0o111, 0o755], ids=["execute-only", "readable"])
async def test_a_tool_cannot_read_or_steal_from_an_execute_only_agent(
    adapter: Adapter, tmp_path: Path, mode: int
) -> None:
    """The readable copy is the control: the same uid reads everything of a dumpable agent."""
    script = f'exec 3<>/dev/tcp/127.0.0.1/{PORT}; python3 -c "$SPY" $$; echo end'
    env = {**ENV, "SPY": SPY, "AGENT_SECRET": "sk-agent-secret"}
    async with await agent_box(adapter, tmp_path, mode) as box:
        done = await box.run([STANDIN, "-c", script], env, timeout=60, agent=True)
    assert done.exit_code == 0, done.stderr
    answers = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line != "end")
    if mode == 0o111:
        assert answers == dict.fromkeys(["environ", "mem", "fd", "ptrace", "pidfd_getfd"], "denied 1") | {
            "environ": "denied 13",
            "mem": "denied 13",
            "fd": "denied 13",
        }
    else:
        assert set(answers.values()) == {"ALLOWED"}


async def test_behind_the_forwarder_every_request_is_a_tools(adapter: Adapter, tmp_path: Path) -> None:
    """Without root (forced here) the proxy sees only socat, which relays for every process alike."""
    socket_path = tmp_path / "adapter.sock"
    binds = {str(standin(tmp_path / "standin", 0o111)): "/opt/standin"}
    box = await BwrapSandbox.create(
        prepare_repo(EXAMPLE_REPO, tmp_path / "repo"),
        network="adapter",
        adapter_socket=socket_path,
        forward_port=int(PORT),
        ro_binds=binds,
    )
    box.proxy = await AdapterProxy(socket_path, adapter.url, box.sandbox_id, owner=box.host_uid).start()
    try:
        done = await box.run([STANDIN, "-c", AGENT_SCRIPT], ENV, timeout=60, agent=True)
    finally:
        await box.close()
        await box.proxy.close()
    assert done.exit_code == 0, done.stderr
    assert set(map(tuple, peers(adapter).values())) == {("tool",)} and len(adapter.heads) == 5
    assert box.enforced["attribution"] == "none: behind socat every request is a tool's"  # and it says so


def test_stamp_head_replaces_every_client_copy_of_the_peer_header() -> None:
    head = (
        b"POST /v1/messages HTTP/1.1\r\nX-Rollbus-Peer: agent\r\nx-rollbus-peer:agent\r\n"
        b"X-ROLLBUS-PEER: agent\r\ncontent-length: 0\r\n"
    )
    for peer in ("agent", "tool"):
        stamped, _, _ = stamp_head(head, "sbx", peer)  # type: ignore[arg-type]
        lines = stamped.lower().split(b"\r\n")
        assert [line for line in lines if line.startswith(b"x-rollbus-peer")] == [
            f"x-rollbus-peer: {peer}".encode()
        ]
    assert b"x-rollbus-peer: tool" in stamp_head(head, "sbx")[0]  # unsaid: a tool's


def test_verdict_is_the_agents_only_when_the_agent_alone_holds_the_socket() -> None:
    cases = {
        (None, frozenset()): "tool",
        (None, frozenset({7})): "tool",
        (7, frozenset()): "tool",  # the socket is gone: nobody can be shown to have sent
        (7, frozenset({8})): "tool",
        (7, frozenset({7, 8})): "tool",  # shared with another process
        (7, frozenset({7})): "agent",
    }
    assert {case: verdict(case[0], set(case[1])) for case in cases} == cases


def test_the_tcp_table_names_the_client_socket_and_its_inode() -> None:
    """Against the kernel's own table: a real loopback connection's client socket found by its addresses."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as client:
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        with accepted:
            tables = [Path(f"/proc/self/net/{name}").read_text() for name in ("tcp", "tcp6")]
            inode = client_inode(tables, client.getsockname(), server.getsockname())
            assert inode == os.fstat(client.fileno()).st_ino
            served = client_inode(tables, server.getsockname(), client.getsockname())
            assert served == os.fstat(accepted.fileno()).st_ino  # the other end's row, read the other way
            assert client_inode(tables, ("127.0.0.1", 1), server.getsockname()) is None
    assert decode_address("0100007F:1F40") == ("127.0.0.1", 8000)
    assert decode_address("0000000000000000FFFF00000100007F:0050") == ("127.0.0.1", 80)
    assert decode_address("00000000000000000000000001000000:0016") == ("::1", 22)
    assert list(tcp_rows("  sl  local_address ...\n")) == []


def test_an_ipv4_client_is_found_without_reading_the_tcp6_table() -> None:
    """Each table read walks every TCP socket of the host (ms of system time per request): the second table
    is read only when the first does not name the socket, and the verdict is the same as over both."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.socket() as client:
        client.connect(server.getsockname())
        accepted, _ = server.accept()
        with accepted:
            tables = _tables(Path("/proc/self/net"))
            inode = client_inode(tables, client.getsockname(), server.getsockname())
            assert inode == os.fstat(client.fileno()).st_ino
            assert "local_address" in next(tables)  # tcp6: still unread, it comes only now
            me = AgentProcess.of(os.getpid())
            assert attribute(me, client.getsockname(), server.getsockname()) == "agent"  # held by us alone
            assert attribute(me, ("127.0.0.1", 1), server.getsockname()) == "tool"  # no such socket


def test_a_connections_socket_is_looked_up_once_and_its_holders_every_time() -> None:
    """The proxy's memo per connection: the table row's inode is kept; who holds it is asked each request."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        me, ends = AgentProcess.of(os.getpid()), (client.getsockname(), server.getsockname())
        known: dict = {}
        with accepted:
            assert attribute(me, *ends, known=known) == "agent"
            assert known == {ends: os.fstat(client.fileno()).st_ino}
            assert attribute(me, *ends, known={ends: 1}) == "tool"  # the memo is used: inode 1 has no holder
            client.close()
            assert attribute(me, *ends, known=known) == "tool"  # the socket gone: held by nobody now


async def test_the_agent_is_pinned_as_the_namespaces_second_process_while_it_runs(tmp_path: Path) -> None:
    """What run(agent=True) hands the proxy: bwrap's command (pid 2 inside), not bwrap's init, not a child."""

    class Proxy:
        agent: asyncio.Future[AgentProcess | None] | None = None

    box = await BwrapSandbox.create(prepare_repo(EXAMPLE_REPO, tmp_path / "repo"))
    box.proxy = Proxy()
    script = "sleep 60 & echo $$ > started; while [ ! -e go ]; do sleep 0.01; done; kill $!"
    run = asyncio.ensure_future(box.run(["sh", "-c", script], ENV, timeout=60, agent=True))
    try:
        while box.proxy.agent is None:
            await asyncio.sleep(0.01)
        pinned = await box.proxy.agent
        assert pinned is not None
        while not (box.host_workdir / "started").exists():  # pinned at fork, maybe before its exec
            await asyncio.sleep(0.01)
        status = Path(f"/proc/{pinned.pid}/status").read_text().splitlines()
        cmdline = Path(f"/proc/{pinned.pid}/cmdline").read_bytes().split(b"\0")
        (box.host_workdir / "go").touch()
        done = await run
    finally:
        await box.close()
    assert done.exit_code == 0, done.stderr
    assert [line.split()[-1] for line in status if line.startswith("NSpid:")] == ["2"]
    assert cmdline[:2] == [b"sh", b"-c"]
    assert box.proxy.agent is None  # the run is over: no process is the agent any more


TOOL_ATTACK = (
    "env | grep -c '^ANTHROPIC_AUTH_TOKEN=';"
    "for f in environ mem; do cat /proc/2/$f >/dev/null 2>&1 && echo READ-$f || echo DENIED-$f; done;"
    "curl -s -o /dev/null -w '%{http_code}\\n' -H 'X-Rollbus-Peer: agent'"
    ' -H "authorization: Bearer $ANTHROPIC_AUTH_TOKEN" -d \'{}\' "$ANTHROPIC_BASE_URL/tool/v1/models"'
)


async def test_the_real_clis_requests_are_the_agents_and_its_bash_tools_are_not(adapter: Adapter) -> None:
    """The runner's own path: the execute-only CLI as the agent command; its Bash tool attacks (the CLI is pid
    2 inside), with the CLI's token from its environment and a forged header."""
    from tests.fake_anthropic import Reply, text, tool_use
    from tests.test_claude_cli_e2e import TOKEN, result_text, tool_results

    replies = [
        Reply([tool_use("toolu_attack", "Bash", {"command": TOOL_ATTACK})], "tool_use"),
        Reply([text("done")], "end_turn"),
    ]
    server = await run_real_cli("Look around.", replies)
    calls = server.message_requests()
    assert len(calls) == 2 and all(c.headers["x-rollbus-peer"] == "agent" for c in calls)
    [forged] = [r for r in server.requests if r.path == "/tool/v1/models"]
    assert forged.headers["x-rollbus-peer"] == "tool"  # with the CLI's own token: the token proves nothing
    assert forged.headers["authorization"] == f"Bearer {TOKEN}"
    output = result_text(tool_results(calls[1].body or {})["toolu_attack"]).split()
    assert output == ["1", "DENIED-environ", "DENIED-mem", "404"]  # 1: the CLI hands its token to its tools


async def test_the_real_clis_sub_agent_runs_in_its_process_and_is_stamped_agent(adapter: Adapter) -> None:
    """An ``Agent`` call's sub-agent is the CLI's own loop (in the same process): its requests, which carry
    ``x-claude-code-agent-id``, are the agent's; only processes the CLI starts are tools."""
    from tests.fake_anthropic import Reply, text, tool_use

    replies = [
        Reply([tool_use("toolu_sub", "Agent", {"description": "look", "prompt": "Say hi."})], "tool_use"),
        Reply([text("hi")], "end_turn"),  # the sub-agent's
        Reply([text("done")], "end_turn"),
    ]
    server = await run_real_cli("Delegate.", replies)
    calls = server.message_requests()
    assert [("x-claude-code-agent-id" in c.headers) for c in calls] == [False, True, False]
    assert [c.headers["x-rollbus-peer"] for c in calls] == ["agent"] * 3


@pytest.mark.parametrize("known", ["this process", "raises", "none", "never", "cancelled"])
async def test_the_proxy_stamps_tool_whenever_the_agent_is_not_known(
    adapter: Adapter, known: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy on a host listener with this test's own process as the client: it is the agent only when the
    agent's future names this process; a future that fails, names nobody, never resolves or is cancelled (the
    run ended) stamps ``tool``."""
    import rollbus.sandbox.adapter_proxy as adapter_proxy

    monkeypatch.setattr(adapter_proxy, "AGENT_WAIT_S", 0.2)
    agent: asyncio.Future[AgentProcess | None] = asyncio.get_running_loop().create_future()
    if known == "this process":
        agent.set_result(AgentProcess.of(os.getpid()))
    elif known == "raises":
        agent.set_exception(RuntimeError("the pin failed"))
    elif known == "none":
        agent.set_result(None)
    elif known == "cancelled":
        agent.cancel()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    proxy = AdapterProxy(None, adapter.url, "sbx", listener=listener)
    proxy.agent = agent
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection(*listener.getsockname())
        writer.write(b"POST /probe HTTP/1.1\r\nx-rollbus-peer: agent\r\ncontent-length: 2\r\n\r\nhi")
        assert (
            await reader.readexactly(REPLY_BYTES)
            == b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nadapter:hi"
        )
        writer.close()
    finally:
        await proxy.close()
    assert peers(adapter) == {"/probe": ["agent" if known == "this process" else "tool"]}


async def run_real_cli(prompt: str, replies: list[Any]) -> Any:
    """The real CLI, execute-only, as the sandbox's agent against a scripted Anthropic server; the server
    (its recorded requests) once the episode ended cleanly."""
    from rollbus import claude_cli
    from tests.fake_anthropic import FakeAnthropic
    from tests.test_claude_cli_e2e import MODEL, TOKEN

    claude_cli.fetch()
    binary = claude_cli.execute_only_binary()
    async with FakeAnthropic(replies) as server:
        spec = SandboxSpec(
            image=EXAMPLE_REPO,
            adapter_url=server.url,
            base_url=BASE_URL,
            ro_binds={str(binary): claude_cli.SANDBOX_BINARY},
        )
        async with await create_local(spec) as box:
            cmd = claude_cli.build_command(prompt, model=MODEL, max_turns=4, binary=claude_cli.SANDBOX_BINARY)
            env = claude_cli.build_env(BASE_URL, TOKEN, model=MODEL, home=box.home)
            episode = await box.run(cmd, env, timeout=300, agent=True)
    assert episode.exit_code == 0, episode.stderr
    return server
