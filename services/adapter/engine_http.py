"""A lean HTTP/1.1 keep-alive client for the engine's JSON POSTs (``/generate``, ``/abort_request``).

httpx spent ~1.4 ms of CPU on each ``/generate`` call (its request and response models, header checks, h11),
about a tenth of the adapter's whole work per turn; this writes the request in one go and reads the answer
with the event loop's own stream reader (~0.25 ms). It keeps what the adapter used of httpx: a pool of
keep-alive connections (at most ``max_connections``; idle ones dropped after ``keepalive`` seconds, before the
engine's server drops them, and ones the server has closed never reused), a connect timeout, a timeout on
each wait for the socket (httpx's read/write/pool timeouts), and failures raised as :class:`HTTPError`
subclasses named as httpx names them (``ConnectError``, ``ReadTimeout``, ...), so the adapter's messages read
as before. No retries, as before: a call that fails is the turn's failure.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

T = TypeVar("T")
MAX_HEAD = 64 * 1024  # an answer's status line and headers; the engine sends a few hundred bytes


class HTTPError(Exception):
    """A call that got no complete answer."""


class ConnectError(HTTPError):
    pass


class ConnectTimeout(HTTPError):
    pass


class PoolTimeout(HTTPError):
    pass


class WriteError(HTTPError):
    pass


class WriteTimeout(HTTPError):
    pass


class ReadError(HTTPError):
    pass


class ReadTimeout(HTTPError):
    pass


class RemoteProtocolError(HTTPError):
    pass


class LocalProtocolError(HTTPError):
    pass


def _field(name: str, value: str) -> bytes:
    """One header line; ASCII as httpx encodes them (other text raises UnicodeEncodeError, as there), and a
    line break or NUL in it refused, as h11 refuses it, rather than sent as a second header."""
    line = f"{name}: {value}".encode("ascii")
    if any(c in line for c in (b"\r", b"\n", b"\0")):
        raise LocalProtocolError(f"illegal header value in {name}")
    return line


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def _tls() -> ssl.SSLContext:
    """Certificates checked against certifi's bundle, as httpx checks them."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = time.monotonic()

    def reusable(self, keepalive: float) -> bool:
        """Not idle past ``keepalive`` and not closed by the server (its EOF read)."""
        fresh = time.monotonic() - self.idle_since < keepalive
        return fresh and not self.writer.is_closing() and not self.reader.at_eof()

    def close(self) -> None:
        self.writer.close()


class EngineHTTP:
    """POSTs JSON bytes to one ``http://host:port`` base; ``timeout``: seconds each wait on the socket (and
    for a free connection) may take; ``connect_timeout``: seconds to connect."""

    def __init__(
        self, base_url: str, *, timeout: float, connect_timeout: float, max_connections: int, keepalive: float
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL must be http(s)://host[:port][/path], not {base_url!r}")
        self.host, self.port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        self.tls = _tls() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.encode()
        self.timeout, self.connect_timeout, self.keepalive = timeout, connect_timeout, keepalive
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []

    async def post(
        self, path: str, body: bytes, headers: dict[str, str], timeout: float | None = None
    ) -> Answer:
        """``path`` (under the base URL's path) with ``body`` as ``application/json``; ``timeout`` replaces
        the client's for this call."""
        wait = self.timeout if timeout is None else timeout
        head = [f"POST {self.prefix}{path} HTTP/1.1".encode(), b"Host: " + self.host_header]
        head += [_field(name, value) for name, value in headers.items()]
        head += [b"Content-Type: application/json", b"Content-Length: %d" % len(body), b"", b""]
        request = b"\r\n".join(head) + body
        try:
            async with asyncio.timeout(wait):
                await self._slots.acquire()
        except TimeoutError:
            raise PoolTimeout("no free engine connection in time") from None
        try:
            connection = await self._connection(wait)
            try:
                answer, keep = await self._exchange(connection, request, wait)
            except BaseException:
                connection.close()
                raise
            if keep:
                connection.idle_since = time.monotonic()
                self._idle.append(connection)
            else:
                connection.close()
            return answer
        finally:
            self._slots.release()

    async def _connection(self, wait: float) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable(self.keepalive):
                return connection
            connection.close()
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, limit=MAX_HEAD, ssl=self.tls
                )
        except TimeoutError:
            where = f"{self.host}:{self.port}"
            raise ConnectTimeout(f"no connection to {where} in {self.connect_timeout} s") from None
        except OSError as exc:
            raise ConnectError(str(exc) or type(exc).__name__) from None
        return _Connection(reader, writer)

    async def _exchange(self, connection: _Connection, request: bytes, wait: float) -> tuple[Answer, bool]:
        """Send ``request``, read the answer; whether the connection may carry another."""
        reader, writer = connection.reader, connection.writer
        try:
            writer.write(request)
            async with asyncio.timeout(wait):
                await writer.drain()
        except TimeoutError:
            raise WriteTimeout("the engine took no more of the request in time") from None
        except OSError as exc:
            raise WriteError(str(exc) or type(exc).__name__) from None
        status, fields = await self._head(reader, wait)
        close = b"close" in fields.get(b"connection", b"").lower()
        if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            body = await self._chunked(reader, wait)
        elif b"content-length" in fields:
            try:
                length = int(fields[b"content-length"])
            except ValueError:
                raise RemoteProtocolError("the engine sent a content-length that is not a number") from None
            body = await self._read(reader.readexactly(length), wait)
        else:  # HTTP/1.0 style: the body runs to the end of the connection
            body, close = await self._read(reader.read(), wait), True
        return Answer(status, body), not close

    async def _head(self, reader: asyncio.StreamReader, wait: float) -> tuple[int, dict[bytes, bytes]]:
        while True:
            try:
                raw = await self._read(reader.readuntil(b"\r\n\r\n"), wait)
            except asyncio.LimitOverrunError:
                raise RemoteProtocolError("the engine's answer headers are too long") from None
            lines = raw[:-4].split(b"\r\n")
            version, _, rest = lines[0].partition(b" ")
            code = rest[:3]
            if not version.startswith(b"HTTP/1.") or not code.isdigit():
                raise RemoteProtocolError(f"not an HTTP answer: {lines[0][:80]!r}")
            if 100 <= int(code) < 200:
                continue  # an interim answer (100 Continue): the real one follows
            fields = {}
            for line in lines[1:]:
                name, sep, value = line.partition(b":")
                if not sep:
                    raise RemoteProtocolError(f"malformed header line: {line[:80]!r}")
                fields[name.strip().lower()] = value.strip()
            if version == b"HTTP/1.0" and b"keep-alive" not in fields.get(b"connection", b"").lower():
                fields[b"connection"] = b"close"
            return int(code), fields

    async def _chunked(self, reader: asyncio.StreamReader, wait: float) -> bytes:
        parts: list[bytes] = []
        while True:
            line = await self._read(reader.readuntil(b"\r\n"), wait)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise RemoteProtocolError(f"malformed chunk size: {line[:40]!r}") from None
            if size == 0:
                while await self._read(reader.readuntil(b"\r\n"), wait) != b"\r\n":
                    pass  # trailers
                return b"".join(parts)
            parts.append(await self._read(reader.readexactly(size), wait))
            if await self._read(reader.readexactly(2), wait) != b"\r\n":
                raise RemoteProtocolError("a chunk did not end with CRLF")

    async def _read(self, step: Awaitable[T], wait: float) -> T:
        """One wait on the socket, under the timeout; a closed or broken connection is a :class:`ReadError`
        (no answer yet) or a :class:`RemoteProtocolError` (an answer cut short)."""
        try:
            async with asyncio.timeout(wait):
                return await step
        except TimeoutError:
            raise ReadTimeout(f"the engine sent nothing for {wait} s") from None
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                raise RemoteProtocolError("Server disconnected without sending a response.") from None
            raise RemoteProtocolError("the engine closed the connection mid-answer") from None
        except OSError as exc:
            raise ReadError(str(exc) or type(exc).__name__) from None

    async def aclose(self) -> None:
        """Close the idle connections and wait until they are closed (the engine sees them end now)."""
        closing = []
        while self._idle:
            connection = self._idle.pop()
            connection.close()
            closing.append(connection.writer.wait_closed())
        await asyncio.gather(*closing, return_exceptions=True)
