"""An agent sandbox's own network namespace, made on the host with the adapter's listener already inside.

The host (root) makes a fresh network namespace in a throwaway thread (namespaces are per thread; the
thread ends right after, so no host socket is ever made in it by accident), brings its loopback up, and
listens there on ``127.0.0.1:PORT``, the port ``ANTHROPIC_BASE_URL`` names. The sandbox's launcher joins
that namespace before bwrap starts, so the agent's loopback port is served by the host's
:class:`~rollbus.sandbox.adapter_proxy.AdapterProxy` directly: no forwarder process inside, nothing to wait
for, and the listener belongs to this one sandbox, which is how the proxy knows who is calling.

Threat model: the namespace is owned by the host's user namespace, so the agent (no capabilities, in a user
namespace of its own) cannot add interfaces, routes or addresses to it; it holds loopback only, so every
other address is unreachable, and abstract unix sockets of the host (scoped by network namespace) are out
of reach. The agent can connect to the listener and nothing else the host has.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import socket
import struct
from concurrent.futures import ThreadPoolExecutor

from rollbus.sandbox.bwrap_host import CLONE_NEWNET, libc

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
BACKLOG = 128


def _make(port: int) -> tuple[int, socket.socket]:
    """In the calling thread: a new network namespace, loopback up, a listener in it (fd, socket)."""
    if libc().unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    netns = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
            request = struct.pack("16sh", b"lo", 0)
            flags = struct.unpack("16sh", fcntl.ioctl(control, SIOCGIFFLAGS, request))[1]
            fcntl.ioctl(control, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
        listener = socket.create_server(("127.0.0.1", port), backlog=BACKLOG)
        listener.setblocking(False)
    except BaseException:
        os.close(netns)
        raise
    return netns, listener


def _discard(made: asyncio.Future[tuple[int, socket.socket]]) -> None:
    with contextlib.suppress(BaseException):
        netns, listener = made.result()
        os.close(netns)
        listener.close()


async def private_netns(port: int) -> tuple[int, socket.socket]:
    """A fresh network namespace (as an fd to ``setns`` into) with a listener on ``127.0.0.1:port`` in it.

    Needs root (CAP_SYS_ADMIN). The caller owns both: close the socket and the fd when the sandbox is gone.
    """
    pool = ThreadPoolExecutor(1, thread_name_prefix="rollbus-netns")  # one thread, gone afterwards
    made = asyncio.get_running_loop().run_in_executor(pool, _make, port)
    pool.shutdown(wait=False)
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        made.add_done_callback(_discard)
        raise


def _listen_in(path: str, port: int) -> socket.socket:
    """In the calling (throwaway) thread: join the network namespace at ``path``, listen there."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc().setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({path})")
    finally:
        os.close(fd)
    listener = socket.create_server(("127.0.0.1", port), backlog=BACKLOG)
    listener.setblocking(False)
    return listener


async def listener_in(path: str, port: int) -> socket.socket:
    """A listener on ``127.0.0.1:port`` inside an existing network namespace (``/proc/<pid>/ns/net`` of a
    container's process), made from a thread that ends right after, so no host socket is ever made there.
    Needs root. The listener keeps the namespace alive; the caller closes it."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="rollbus-netns")
    made = asyncio.get_running_loop().run_in_executor(pool, _listen_in, path, port)
    pool.shutdown(wait=False)
    return await made
