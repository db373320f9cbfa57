"""Shared parts of the adapter tests: a bus publisher that keeps what it got, real servers on free ports.

No tests here; the adapter test modules import from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from aiokafka.errors import KafkaConnectionError

from rollbus.codec import decode, encode
from rollbus.events import EVENTS
from rollbus.services.adapter.app import create_app
from rollbus.services.adapter.settings import AdapterSettings
from tests.waiting import until, until_sync

ROOT = Path(__file__).resolve().parent.parent
_EVENT_OF_TOPIC = {spec.topic: spec.event_type for spec in EVENTS}

READ_TOOL = {
    "name": "Read",
    "description": "Read a file from the local filesystem.",
    "input_schema": {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"file_path": {"type": "string", "description": "absolute path"}},
        "required": ["file_path"],
        "additionalProperties": False,
    },
}
AGENT_TOOL = {
    "name": "Agent",
    "description": "Launch a sub-agent.",
    "input_schema": {
        "type": "object",
        "properties": {"description": {"type": "string"}, "prompt": {"type": "string"}},
        "required": ["description", "prompt"],
        "additionalProperties": False,
    },
}
SYSTEM = [
    {"type": "text", "text": "You are Claude Code, a coding agent.", "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "Work in /repo."},
]


class BusPublisher:
    """Encodes every record with the real codec (so schema mistakes fail) and keeps the decoded events.

    ``down = True`` makes it refuse like an unreachable broker.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []  # (topic, key, record)
        self.down = False
        self.refused = 0  # sends refused while down

    async def publish(self, topic: str, record: Mapping[str, Any], *, key: str) -> None:
        await self.publish_bytes(topic, encode(_EVENT_OF_TOPIC[topic], record), key=key)

    async def publish_bytes(self, topic: str, value: bytes, *, key: str | bytes | None) -> None:
        if self.down:
            self.refused += 1
            raise KafkaConnectionError("broker unreachable (test)")
        key = key.decode() if isinstance(key, bytes) else key
        self.events.append((topic, key, decode(value).record))  # type: ignore[arg-type]

    def of(self, topic: str, rollout_id: str) -> list[dict[str, Any]]:
        return [r for t, _, r in self.events if t == topic and r["rollout_id"] == rollout_id]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Until ``url`` answers below 500; fails at once if ``proc`` (its server) exits meanwhile."""

    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} server exited with {proc.returncode}")
        try:
            return httpx.get(url, timeout=1.0).status_code < 500
        except httpx.HTTPError:
            return False

    until_sync(answers, f"{url} up", timeout=timeout, interval=0.2)


@contextlib.contextmanager
def engine_process(
    script: dict[str, Any], tmp: Path, codex_script: dict[str, Any] | None = None
) -> Iterator[str]:
    """The real rollbus engine (scripted policy) as a subprocess; yields its base URL. ``codex_script``: what
    it replays to the requests of the Codex harness (``--codex-script``) instead of ``script``."""
    script_file = tmp / "script.json"
    script_file.write_text(json.dumps(script))
    codex = []
    if codex_script is not None:
        (tmp / "codex-script.json").write_text(json.dumps(codex_script))
        codex = ["--codex-script", str(tmp / "codex-script.json")]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rollbus.services.engine",
        "--policy",
        "scripted",
        "--script",
        str(script_file),
        "--port",
        str(port),
        "--threads",
        "1",
        *codex,
    ]
    log = (tmp / "engine.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 300, proc)  # a loaded CI box takes minutes to import the engine
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class StalledEngine:
    """A real HTTP server that holds ``/generate`` calls (a slow prefill) until :meth:`release`, then
    answers them with ``answer_ids``; it records the request ids of ``/abort_request`` calls."""

    def __init__(
        self, answer_ids: list[int] | None = None, *, status: int = 200, released: bool = False
    ) -> None:
        self.answer_ids = answer_ids or []
        self.status = status  # a 4xx answers ``{"error": ...}`` as SGLang's bad requests
        self.bodies: list[dict[str, Any]] = []  # every /generate body, as received
        self.headers: list[dict[str, str]] = []  # every request's headers, lower-cased names
        self.aborted: list[str] = []
        self.generating = 0
        self._released = asyncio.Event()
        if released:
            self._released.set()
        self._server: asyncio.Server | None = None
        self.url = ""

    def release(self) -> None:
        self._released.set()

    def hold(self) -> None:
        """Stall the next ``/generate`` calls again."""
        self._released.clear()

    async def __aenter__(self) -> StalledEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                body = json.loads(await reader.readexactly(length) or b"{}")
                self.headers.append(
                    {
                        k.strip().lower(): v.strip()
                        for k, _, v in (line.decode().partition(":") for line in head.split(b"\r\n")[1:])
                        if k
                    }
                )
                if path == "/abort_request":
                    self.aborted.append(body["rid"])
                    self._respond(writer, {})
                elif self.status != 200:
                    self.bodies.append(body)
                    self._respond(writer, {"error": {"message": "bad sampling params (test)"}}, self.status)
                else:
                    self.bodies.append(body)
                    self.generating += 1
                    await self._released.wait()
                    self._respond(writer, self._generation(body))
                await writer.drain()
        writer.close()

    def _generation(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = self.answer_ids
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "stop", "matched": ids[-1] if ids else None},
            "prompt_tokens": len(body["input_ids"]),
            "weight_version": "3",
            "output_token_logprobs": [[-0.25, i, None] for i in ids],
        }
        return {"text": "", "output_ids": ids, "meta_info": meta}

    @staticmethod
    def _respond(writer: asyncio.StreamWriter, data: dict[str, Any], status: int = 200) -> None:
        payload = json.dumps(data).encode()
        head = (
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        )
        writer.write(head.encode() + payload)


@contextlib.asynccontextmanager
async def served(app: Any, prepare: Callable[[uvicorn.Server], None] | None = None):
    """``app`` on a real uvicorn server on a free port, in this event loop; ``prepare`` runs before it
    starts (and so before it installs its signal handlers)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    if prepare is not None:
        prepare(server)
    task = asyncio.create_task(server.serve())
    # a serve() that failed raises here at once (its result), rather than at the deadline
    started = lambda: server.started or (task.done() and task.result())  # noqa: E731
    await until(started, "the server started", interval=0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        await task


def settings(sglang_url: str, **overrides: Any) -> AdapterSettings:
    base = {
        "state_dir": Path(tempfile.gettempdir()) / "rollbus-adapter-tests",
        "sglang_url": sglang_url,
        "open_sessions": True,
        "ping_interval": 0.05,
        "context_length": 4096,
        "max_new_tokens": 512,
    }
    return AdapterSettings(**{**base, **overrides})


@contextlib.asynccontextmanager
async def adapter_client(
    settings: AdapterSettings, publisher: Any, *, raise_app_exceptions: bool = True, app: Any = None
) -> AsyncIterator[httpx.AsyncClient]:
    """The adapter app in process (lifespan included), reached through httpx's ASGI transport."""
    app = app or create_app(settings, publisher)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://adapter", timeout=60) as client:
            client.app = app  # type: ignore[attr-defined]
            yield client


@contextlib.asynccontextmanager
async def scripted_adapter(engine_url: str, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """:func:`adapter_client` in front of ``engine_url`` with admin token ``adm``; what it publishes is on
    ``client.publisher`` (a :class:`BusPublisher`)."""
    publisher = BusPublisher()
    async with adapter_client(settings(engine_url, admin_token="adm", **options), publisher) as client:
        client.publisher = publisher  # type: ignore[attr-defined]
        yield client


def body(messages: list[dict[str, Any]] | str, **overrides: Any) -> dict[str, Any]:
    """A request body shaped like the CLI's."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": [{"type": "text", "text": messages}]}]
    base = {
        "model": "qwen3.6-test",
        "max_tokens": 256,
        "system": SYSTEM,
        "tools": [READ_TOOL, AGENT_TOOL],
        "messages": messages,
        "metadata": {"user_id": json.dumps({"session_id": "s"})},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": []},
        "stream": True,
    }
    return {**base, **overrides}


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) per SSE event; checks each ``event:`` line names its data's type."""
    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"], chunk
        events.append((lines["event"], data))
    return events


def message_from_events(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Rebuild the final message from a stream, the way an SDK accumulates it."""
    message = dict(events[0][1]["message"])
    blocks: list[dict[str, Any]] = []
    for name, data in events[1:]:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = blocks[data["index"]], data["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] += delta["signature"]
            elif delta["type"] == "input_json_delta":
                block["_json"] = block.get("_json", "") + delta["partial_json"]
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"] = data["usage"]
    for block in blocks:
        if "_json" in block:
            block["input"] = json.loads(block.pop("_json"))
    message["content"] = blocks
    return message
