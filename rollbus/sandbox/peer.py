"""Which process inside an agent sandbox sent a request to the adapter proxy: the agent itself, or a tool.

The proxy listens in the sandbox's own network namespace, so the client's socket is a row of that namespace's
TCP table (``/proc/<pid>/net/tcp``, read through any process inside): the row whose local end is the peer's
address and whose remote end is the listener names the client socket's inode, and the processes holding
``socket:[inode]`` in a file table (every task's: a thread with a table of its own hides nothing) are the ones
that can write on it. A request is the agent's only when the agent process holds that socket and nothing else
in its PID namespace does. Everything else is a tool's, failing closed: no agent named, the agent gone or its
pid reused, the row or the socket vanished, a second holder. It is all read from the host's ``/proc`` as
root: evidence outside the sandbox that nothing inside can write.

Why a tool cannot borrow the agent's identity: it cannot hold the agent's socket (the agent opens it
close-on-exec, and taking it with ``pidfd_getfd`` needs ptrace rights), nor make the agent send for it
(ptrace, ``/proc/<pid>/mem``): the agent runs an execute-only binary, which the kernel makes non-dumpable, so
neither right is granted to its same-uid tools (:func:`rollbus.claude_cli.execute_only_binary`).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Peer = Literal["agent", "tool"]
Address = tuple[str, int]
PROC = Path("/proc")
TCP_TABLES = ("tcp", "tcp6")


@dataclass(frozen=True)
class AgentProcess:
    """The agent's process as the host sees it; ``start`` (ticks after boot) tells a reused pid apart."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int, proc: Path = PROC) -> AgentProcess | None:
        start = start_time(pid, proc)
        return None if start is None else cls(pid, start)

    def alive(self, proc: Path = PROC) -> bool:
        return start_time(self.pid, proc) == self.start


def start_time(pid: int, proc: Path = PROC) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (after the command name, which may hold spaces and parentheses)."""
    try:
        stat = (proc / str(pid) / "stat").read_bytes()
    except OSError:
        return None
    return int(stat.rpartition(b")")[2].split()[19])


def command_pid(init: int, proc: Path = PROC) -> int | None:
    """The host pid of the command bwrap started under the PID namespace init ``init``: init's child whose pid
    inside is 2 (the namespace's first fork, so never an orphan reparented to init later); None before it
    exists."""
    try:
        children = (proc / str(init) / "task" / str(init) / "children").read_text().split()
    except OSError:
        return None
    for child in children:
        try:
            status = (proc / child / "status").read_text()
        except OSError:
            continue
        nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
        if nspid[-1:] == ["2"]:
            return int(child)
    return None


def decode_address(field: str) -> Address:
    """``0100007F:1F40`` -> ``("127.0.0.1", 8000)``: each 32-bit word of the address in host byte order."""
    address, _, port = field.partition(":")
    raw = b"".join(struct.pack("=I", int(address[i : i + 8], 16)) for i in range(0, len(address), 8))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    host = socket.inet_ntop(family, raw)
    if family == socket.AF_INET6 and host.startswith("::ffff:") and "." in host:
        host = host.removeprefix("::ffff:")  # an IPv4 peer of a dual-stack socket
    return host, int(port, 16)


def tcp_rows(table: str) -> Iterator[tuple[Address, Address, int]]:
    """(local, remote, inode) of each row of a ``/proc/net/tcp`` or ``tcp6`` table (its header skipped)."""
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 10:
            yield decode_address(fields[1]), decode_address(fields[2]), int(fields[9])


def client_inode(tables: Iterable[str], client: Address, server: Address) -> int | None:
    """The inode of the socket at ``client`` connected to ``server``; None when it is gone (0: closed)."""
    for table in tables:
        for local, remote, inode in tcp_rows(table):
            if (local, remote) == (client, server):
                return inode or None
    return None


def verdict(agent_pid: int | None, holders: set[int]) -> Peer:
    """The agent's only when the agent alone holds the socket."""
    return "agent" if agent_pid is not None and holders == {agent_pid} else "tool"


def holders(inode: int, pid_namespace: str, agent: int, proc: Path = PROC) -> set[int]:
    """The processes of ``pid_namespace`` (a ``/proc/<pid>/ns/pid`` link) with ``socket:[inode]`` in a file
    table: every task's table for each process but the agent, whose threads share one (a socket only a
    thread of its own held would be missed there, which makes the request a tool's: failing closed)."""
    wanted = f"socket:[{inode}]"
    found = set()
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(f"{entry.path}/ns/pid") != pid_namespace:
                continue
            tasks = [entry.name] if int(entry.name) == agent else os.listdir(f"{entry.path}/task")
        except OSError:  # gone meanwhile
            continue
        if any(_holds(f"{entry.path}/task/{task}/fd", wanted) for task in tasks):
            found.add(int(entry.name))
    return found


def _holds(fds: str, wanted: str) -> bool:
    try:
        names = os.listdir(fds)
    except OSError:
        return False
    return any(_link(f"{fds}/{fd}") == wanted for fd in names)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # no IPv6 here, or the process is gone (then nothing matches)
        return None


def _tables(net: Path) -> Iterator[str]:
    """The TCP tables in order, each read only when the one before did not name the socket: the kernel walks
    every TCP socket of the host to print one namespace's table (milliseconds of system time per read)."""
    for name in TCP_TABLES:
        if (table := _read(net / name)) is not None:
            yield table


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def attribute(
    agent: AgentProcess | None,
    client: Address,
    server: Address,
    proc: Path = PROC,
    known: dict[tuple[Address, Address], int] | None = None,
) -> Peer:
    """Who sent on the connection from ``client`` to the listener at ``server`` (see the module docstring).

    ``known``: the proxy's memo for one accepted connection. Its client socket (the table row's inode) is
    the same for the connection's life, so the table, costly to read, is read on its first request only;
    who holds that socket is asked afresh every time (a gone socket has no holder: a tool's)."""
    if agent is None or not agent.alive(proc):
        return "tool"
    base = proc / str(agent.pid)
    try:
        namespace = os.readlink(base / "ns" / "pid")
    except OSError:
        return "tool"
    inode = None if known is None else known.get((client, server))
    if inode is None:
        inode = client_inode(_tables(base / "net"), client, server)
        if inode is None:
            return "tool"
        if known is not None:
            known[(client, server)] = inode
    found = holders(inode, namespace, agent.pid, proc)
    return verdict(agent.pid, found) if agent.alive(proc) else "tool"
