"""The adapter's engine HTTP client against a raw socket server that answers as servers do: keep-alive,
chunked, closed connections, silence, refusal."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest

from rollbus.services.adapter import engine_http
from rollbus.services.adapter.engine_http import EngineHTTP
from tests.test_adapter_support import free_port

Answer = Callable[[bytes], bytes | None]  # request head + body -> raw answer (None: say nothing)


@contextlib.asynccontextmanager
async def server(answer: Answer, *, close_after: bool = False) -> AsyncIterator[tuple[str, list[int]]]:
    """A server answering each request with ``answer``; yields its URL and the count of connections made."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
                raw = answer(head + await reader.readexactly(length))
                if raw is None:
                    await asyncio.sleep(30)
                    break
                writer.write(raw)
                await writer.drain()
                if close_after or not raw:
                    break
        writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}/base", connections
    finally:
        srv.close()


def client(url: str, **options: float) -> EngineHTTP:
    kw = {"timeout": 5.0, "connect_timeout": 5.0, "max_connections": 4, "keepalive": 5.0, **options}
    return EngineHTTP(url, **kw)  # type: ignore[arg-type]


def echo(request: bytes) -> bytes:
    """200 with the request's path and body, content-length framed."""
    path = request.split(b" ", 2)[1]
    body = path + b"|" + request.split(b"\r\n\r\n", 1)[1]
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )


async def test_one_connection_carries_every_call_and_the_base_path_is_kept() -> None:
    async with server(echo) as (url, connections):
        http = client(url)
        for i in range(3):
            answer = await http.post("/generate", b'{"n": %d}' % i, {"X-Rollbus-Rollout": "r"})
            assert (answer.status, answer.body) == (200, b'/base/generate|{"n": %d}' % i)
        await http.aclose()
    assert len(connections) == 1


async def test_chunked_answers_and_interim_answers_are_read_whole() -> None:
    def chunked(request: bytes) -> bytes:
        return (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Busy\r\ntransfer-encoding: chunked\r\n\r\n"
            b"5;x=y\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: 1\r\n\r\n"
        )

    async with server(chunked) as (url, connections):
        http = client(url)
        first = await http.post("/generate", b"{}", {})
        second = await http.post("/generate", b"{}", {})
        await http.aclose()
    assert (first.status, first.text) == (second.status, second.text) == (503, "hello world")
    assert len(connections) == 1


async def test_a_connection_the_server_closed_or_kept_idle_too_long_is_not_reused() -> None:
    def closing(request: bytes) -> bytes:
        return echo(request).replace(b"content-type", b"connection: close\r\ncontent-type")

    async with server(closing) as (url, connections):
        http = client(url)
        for _ in range(2):
            assert (await http.post("/x", b"1", {})).status == 200
    assert len(connections) == 2  # the answer said close
    async with server(echo, close_after=True) as (url, connections):
        http = client(url)
        for _ in range(2):
            assert (await http.post("/x", b"1", {})).status == 200
            await asyncio.sleep(0.05)  # the server's FIN arrives while the connection is idle
    assert len(connections) == 2
    async with server(echo) as (url, connections):
        http = client(url, keepalive=0.05)
        for _ in range(2):
            assert (await http.post("/x", b"1", {})).status == 200
            await asyncio.sleep(0.1)
        await http.aclose()
    assert len(connections) == 2


async def test_failures_are_named_as_httpx_names_them() -> None:
    with pytest.raises(engine_http.ConnectError):
        await client(f"http://127.0.0.1:{free_port()}").post("/generate", b"{}", {})
    async with server(lambda request: None) as (url, _):
        with pytest.raises(engine_http.ReadTimeout):
            await client(url, timeout=0.2).post("/generate", b"{}", {})
    async with server(lambda request: b"") as (url, _):  # closes without a word
        with pytest.raises(engine_http.RemoteProtocolError, match="without sending a response"):
            await client(url).post("/generate", b"{}", {})
    short = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"
    async with server(lambda request: short, close_after=True) as (url, _):
        with pytest.raises(engine_http.RemoteProtocolError, match="mid-answer"):
            await client(url).post("/generate", b"{}", {})
    async with server(lambda request: b"SSH-2.0-OpenSSH\r\n\r\n") as (url, _):
        with pytest.raises(engine_http.RemoteProtocolError, match="not an HTTP answer"):
            await client(url).post("/generate", b"{}", {})


async def test_a_header_value_cannot_smuggle_a_second_header_or_request() -> None:
    async with server(echo) as (url, connections):
        http = client(url)
        for value in ("r\r\nX-Evil: 1", "r\nPOST /abort_request HTTP/1.1", "r\x00"):
            with pytest.raises(engine_http.LocalProtocolError):
                await http.post("/generate", b"{}", {"X-Rollbus-Rollout": value})
    assert connections == []  # refused before anything was sent
