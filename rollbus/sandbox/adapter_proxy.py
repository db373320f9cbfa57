"""Host side of the agent's only way out: a per-sandbox unix socket that proxies HTTP to the adapter.

The agent sandbox has its own network namespace with nothing but loopback. The proxy listens either on the
loopback port ``ANTHROPIC_BASE_URL`` names inside that namespace (a listening socket the host made there,
:mod:`rollbus.sandbox.netns`), or on a unix socket bind-mounted at ``/run/adapter.sock`` that a ``socat``
forwarder inside connects that port to. The proxy opens one TCP connection to the adapter per client
connection and stamps every request with ``X-Rollbus-Sandbox: <sandbox id>`` (a copy the client sent is
removed first), so the adapter side knows which rollout is calling whatever token the request carries, and
with ``X-Rollbus-Peer: agent`` or ``X-Rollbus-Peer: tool`` (likewise replacing any copy the client sent):
``agent`` only when the request came from the agent process itself (:attr:`AdapterProxy.agent`, set by the
sandbox while the agent's command runs) over a socket nothing else holds, found from the host's ``/proc``
(:mod:`rollbus.sandbox.peer`); everything else, a tool the agent spawned or anything unresolvable, is
``tool``. On the unix socket the only peer the proxy can see is the ``socat`` forwarder, which relays for
every process alike, so there every request is ``tool``: nothing sent through the forwarder is the agent's.
Only HTTP/1.1 requests pass: a head that does not parse, or is larger than ``MAX_HEAD``, gets a 400 and the
connection closes; connections past ``MAX_CONNECTIONS`` get a 503, so one agent cannot exhaust the host's
sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

from rollbus.sandbox.peer import Address, AgentProcess, Peer, attribute

log = logging.getLogger("rollbus.sandbox.adapter_proxy")
SANDBOX_HEADER = b"x-rollbus-sandbox"
PEER_HEADER = b"x-rollbus-peer"  # "agent" or "tool": "tool" never trains (no header: a host-side caller)
MAX_HEAD = 64 << 10
CHUNK = 1 << 16
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
BUSY = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
AGENT_WAIT_S = 10.0  # a request that comes before the agent's process is known waits for it this long
MAX_CONNECTIONS = 64  # per sandbox: an agent opening thousands cannot exhaust the host's sockets


class BadRequest(ValueError):
    """The client's bytes are not an HTTP/1.1 request we forward."""


def stamp_head(head: bytes, sandbox_id: str, peer: Peer = "tool") -> tuple[bytes, int | None, bool]:
    """Rewrite a request head: drop any client copy of our headers, add ours.

    Returns the new head, the Content-Length (None if absent) and whether the body is chunked.
    """
    lines = head.split(b"\r\n")
    request_line, headers = lines[0], [h for h in lines[1:] if h]
    if len(request_line.split(b" ")) != 3 or not request_line.endswith((b"HTTP/1.1", b"HTTP/1.0")):
        raise BadRequest(f"not an HTTP request line: {request_line[:80]!r}")
    kept, length, chunked = [], None, False
    for header in headers:
        name, sep, value = header.partition(b":")
        if not sep or not name or name != name.strip():
            raise BadRequest(f"malformed header: {header[:80]!r}")
        key = name.lower()
        if key in (SANDBOX_HEADER, PEER_HEADER):
            continue
        if key == b"content-length":
            if length is not None or not value.strip().isdigit():
                raise BadRequest("bad or repeated content-length")
            length = int(value.strip())
        if key == b"transfer-encoding":
            chunked = value.strip().lower() == b"chunked"
            if not chunked:
                raise BadRequest("unsupported transfer-encoding")
        kept.append(header)
    if chunked and length is not None:
        raise BadRequest("both content-length and chunked")
    ours = [SANDBOX_HEADER + b": " + sandbox_id.encode(), PEER_HEADER + b": " + peer.encode()]
    stamped = [request_line, *kept, *ours, b"", b""]
    return b"\r\n".join(stamped), length, chunked


async def _copy_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        chunk = await reader.read(min(n, CHUNK))
        if not chunk:
            raise BadRequest("body ended early")
        writer.write(chunk)
        n -= len(chunk)
        await writer.drain()


async def _copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        size_line = await reader.readuntil(b"\r\n")
        writer.write(size_line)
        try:
            size = int(size_line.split(b";")[0].strip(), 16)
        except ValueError as exc:
            raise BadRequest("bad chunk size") from exc
        if size == 0:
            while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                writer.write(trailer)
            writer.write(b"\r\n")
            await writer.drain()
            return
        await _copy_exact(reader, writer, size + 2)


class AdapterProxy:
    """One sandbox's way out, proxying to the adapter at ``adapter_url`` (``http://host:port``).

    It serves a unix socket at ``socket_path``, or ``listener``: a listening socket of the sandbox's own.
    ``agent`` is the agent's process while it runs, as a future (the sandbox sets it when it starts the
    agent, and it resolves once the process exists); None: every request is a tool's.
    """

    agent: asyncio.Future[AgentProcess | None] | None = None

    def __init__(
        self,
        socket_path: Path | None,
        adapter_url: str,
        sandbox_id: str,
        owner: int | None = None,
        max_connections: int = MAX_CONNECTIONS,
        listener: socket.socket | None = None,
    ) -> None:
        if (socket_path is None) == (listener is None):
            raise ValueError("an adapter proxy serves either a unix socket path or a listener")
        parts = urlsplit(adapter_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"adapter URL must be http://host:port, got {adapter_url!r}")
        self.socket_path = Path(socket_path) if socket_path is not None else None
        self._listener = listener
        self.sandbox_id = sandbox_id
        self._target = (parts.hostname, parts.port or 80)
        self._owner = owner
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.requests = 0
        self.refused = 0
        self._max_connections = max_connections

    async def start(self) -> AdapterProxy:
        if self._listener is not None:
            self._server = await asyncio.start_server(self._serve, sock=self._listener)
            return self
        assert self.socket_path is not None
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        if self._owner is not None:
            os.chown(self.socket_path, self._owner, self._owner)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None
        if self._listener is not None:
            self._listener.close()  # also when start never ran
        if self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._tasks) >= self._max_connections:
            self.refused += 1
            with contextlib.suppress(ConnectionError):
                client_w.write(BUSY)
                await client_w.drain()
            client_w.close()
            return
        self._tasks.add(task)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            upstream_r, upstream_w = await asyncio.open_connection(*self._target)
            back = asyncio.ensure_future(_pump(upstream_r, client_w))
            try:
                await self._requests(client_r, client_w, upstream_w)
                await back
            finally:
                back.cancel()
        except (BadRequest, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            with contextlib.suppress(ConnectionError):
                client_w.write(BAD_REQUEST)
                await client_w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            for writer in (client_w, upstream_w):
                if writer is not None:
                    writer.close()
            self._tasks.discard(task)

    async def _requests(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, upstream_w: asyncio.StreamWriter
    ) -> None:
        known: dict[tuple[Address, Address], int] = {}  # its client socket, once found (peer.attribute)
        while True:
            try:
                head = await client_r.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise BadRequest("request head ended early") from exc
                upstream_w.write_eof()
                return
            if len(head) > MAX_HEAD:
                raise BadRequest("request head too large")
            peer = await self._peer(client_w, known)
            stamped, length, chunked = stamp_head(head[:-4] + b"\r\n", self.sandbox_id, peer)
            self.requests += 1
            upstream_w.write(stamped)
            if chunked:
                await _copy_chunked(client_r, upstream_w)
            elif length:
                await _copy_exact(client_r, upstream_w, length)
            await upstream_w.drain()

    async def _peer(self, client_w: asyncio.StreamWriter, known: dict[tuple[Address, Address], int]) -> Peer:
        """Who sent this request, decided afresh for each one (a socket can change hands between requests)."""
        if self._listener is None:
            return "tool"  # the forwarder's connection: every process inside looks the same from here
        client, server = client_w.get_extra_info("peername"), client_w.get_extra_info("sockname")
        if self.agent is None or not client or not server:
            return "tool"
        try:
            agent = await asyncio.wait_for(asyncio.shield(self.agent), AGENT_WAIT_S)
            return await asyncio.to_thread(attribute, agent, client[:2], server[:2], known=known)
        except asyncio.CancelledError:
            task = asyncio.current_task()  # this coroutine runs as a task: never None here
            if task is not None and task.cancelling():
                raise
            return "tool"  # the agent's run ended
        except TimeoutError:
            return "tool"  # its process never appeared
        except Exception:  # nothing proves the agent sent it
            log.exception("sandbox %s: attributing a request failed; stamped tool", self.sandbox_id)
            return "tool"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
