"""The pieces end-to-end tests of the real Claude Code CLI share: one adapter, a scripted engine behind it,
episodes in bwrap, and the rollout's events read back from the bus.

The adapter is started once per session (it is the slow part to load: tokenizer, SGLang parsers; the
conftest's ``session_rig``) and publishes to a topic namespace of its own. The scripted engine replays one
script per process, so :class:`Rig` restarts it on the same port when a test needs another script; tests
grouped by script restart it rarely.
"""

from __future__ import annotations

import json
import os
import re
import signal
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rollbus import claude_cli, codex_cli
from rollbus.kafka.broker import free_port
from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import topic_name
from rollbus.sandbox import BwrapSandbox, Completed, prepare_repo
from rollbus.trajectory import Segment, Turn, fan_out
from rollbus.turn_log import frozen_chains, resolve_turns
from tests.service_process import ServiceProcess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPTS = EXAMPLES / "scripts"
MODEL = "rollbus-engine"
SANDBOX_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}  # no __pycache__ in the agent's diff
START_TIMEOUT = 300.0  # a service's start on a loaded box (the engine alone took 97 s at load 12)
HTTP_TIMEOUT = 60.0  # a busy adapter (tokenizing a turn on a loaded box) answers /metrics past httpx's 5 s


class Rig:
    """The shared adapter, and the scripted engine on a fixed port that it calls."""

    def __init__(self, bootstrap: str, namespace: str, log_dir: Path) -> None:
        self.bootstrap, self.namespace, self.log_dir = bootstrap, namespace, log_dir
        self.engine_port, self.adapter_port = free_port(), free_port()
        self.admin_token = uuid.uuid4().hex
        self.url = f"http://127.0.0.1:{self.adapter_port}"
        self.script: Path | None = None
        self.engine: ServiceProcess | None = None
        self.adapter = ServiceProcess(
            "adapter",
            ["--port", str(self.adapter_port), "--sglang-url", f"http://127.0.0.1:{self.engine_port}",
             "--bootstrap-servers", bootstrap, "--namespace", namespace,
             "--admin-token", self.admin_token, "--state-dir", str(log_dir),
             "--signing-key", uuid.uuid4().hex],  # shared by its restarts: tokens and ids stay valid
            health_url=f"{self.url}/healthz",
            log_dir=log_dir,
        )  # fmt: skip

    def start(self) -> None:
        self.adapter.start(timeout=START_TIMEOUT)

    def stop(self) -> None:
        self.stop_engine()
        self.adapter.stop()

    def ensure_adapter(self) -> None:
        """Start the adapter again if it is not running (same port, state directory and signing key)."""
        if self.adapter.proc is None or self.adapter.proc.poll() is not None:
            self.adapter.start(timeout=START_TIMEOUT)

    def kill_adapter(self) -> None:
        """``kill -9`` the adapter: no drain, no spill, whatever it held in memory is gone."""
        assert self.adapter.proc is not None
        os.killpg(self.adapter.proc.pid, signal.SIGKILL)
        self.adapter.proc.wait()

    def use_script(self, script: Path) -> None:
        """Serve ``script`` (a fresh engine, so every rollout's cursor starts at its first turn)."""
        if self.script != script or self.engine is None or self.engine.proc is None:
            self.start_engine(script)

    def start_engine(self, script: Path) -> None:
        self.stop_engine()
        self.engine = ServiceProcess(
            "engine",
            ["--port", str(self.engine_port), "--policy", "scripted", "--script", str(script)],
            health_url=f"http://127.0.0.1:{self.engine_port}/health",
            log_dir=self.log_dir / script.stem,
        )
        self.engine.start(timeout=START_TIMEOUT)
        self.script = script

    def stop_engine(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.engine = None

    def admin(self) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {self.admin_token}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=HTTP_TIMEOUT)

    async def open_session(self, rollout_id: str, harness: str = "claude_code") -> str:
        body = {"rollout_id": rollout_id, "harness": harness}
        async with self.admin() as http:
            answer = (await http.post("/admin/sessions", json=body)).raise_for_status()
        return answer.json()["token"]

    async def close_session(self, rollout_id: str) -> dict[str, Any]:
        async with self.admin() as http:
            return (await http.post(f"/admin/sessions/{rollout_id}/close")).raise_for_status().json()

    async def close_session_if_open(self, rollout_id: str) -> None:
        """Close the rollout's session; a 404 (no request ever opened it on the adapter) is fine."""
        async with self.admin() as http:
            answer = await http.post(f"/admin/sessions/{rollout_id}/close")
        if answer.status_code != 404:
            answer.raise_for_status()

    async def metric(self, name: str, **labels: str) -> float:
        """The adapter's Prometheus sample ``name`` with these labels summed over the others (0 if absent)."""
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
            text = (await http.get(f"{self.url}/metrics")).raise_for_status().text
        total = 0.0
        for sample in re.finditer(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", text, re.MULTILINE):
            found = dict(re.findall(r'(\w+)="([^"]*)"', sample.group(1) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(sample.group(2))
        return total

    async def answered(self, status: int, route: str = "/v1/messages") -> int:
        """How many requests on ``route`` the adapter answered with ``status``."""
        return int(await self.metric("rollbus_adapter_requests_total", route=route, status=str(status)))


@dataclass
class Rollout:
    """One episode of the CLI: its exit and stream-json output, its repository, its events on the bus."""

    rollout_id: str
    completed: Completed
    workdir: Path
    turns: list[dict[str, Any]]  # turn records, bus order
    sessions: list[dict[str, Any]]  # session records, bus order

    @property
    def events(self) -> list[dict[str, Any]]:
        return stream_events(self.completed.stdout)

    @property
    def result(self) -> dict[str, Any]:
        """The CLI's closing ``result`` event (raises if it printed none)."""
        return next(e for e in reversed(self.events) if e.get("type") == "result")

    def resolved(self) -> list[Turn]:
        return resolve_turns(self.turns)

    def segments(self, reward: float) -> list[Segment]:
        """What the segmenter makes of the rollout: turns -> frozen chains -> reward/K segments."""
        kinds = {r["chain_id"]: r["chain_kind"] for r in self.turns}
        return fan_out(frozen_chains(self.resolved(), kinds), self.rollout_id, reward)


async def play(
    rig: Rig, tmp_path: Path, prompt: str, *, token: str | None = None, rollout_id: str = "", **cli: Any
) -> Rollout:
    """A fresh session and scratch repo (``tmp_path / rollout_id``), the CLI run to its end, the session
    closed, its events read. With ``token`` the CLI uses that token instead (no session is opened)."""
    rollout_id = rollout_id or new_rollout_id()
    session_token = await rig.open_session(rollout_id) if token is None else token
    workdir = prepare_repo(EXAMPLES / "buggy_repo", tmp_path / rollout_id)
    completed = await run_claude(rig.url, session_token, workdir, prompt, **cli)
    (tmp_path / f"{rollout_id}.stream.jsonl").write_text(completed.stdout)  # for a failure's post-mortem
    if token is None:
        await rig.close_session(rollout_id)
    turns = await rollout_events(rig.bootstrap, rig.namespace, "turns", rollout_id)
    sessions = await rollout_events(rig.bootstrap, rig.namespace, "sessions", rollout_id)
    return Rollout(rollout_id, completed, workdir, turns, sessions)


def new_rollout_id() -> str:
    return f"e2e-{uuid.uuid4().hex[:10]}"


def stream_events(stdout: str) -> list[dict[str, Any]]:
    """The JSON lines of ``--output-format stream-json`` (anything else on stdout is skipped)."""
    events = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            events.append(json.loads(line))
    return events


async def run_claude(
    base_url: str,
    token: str,
    workdir: Path,
    prompt: str,
    *,
    max_turns: int = 8,
    env: Mapping[str, str] | None = None,
    max_output_tokens: int = claude_cli.DEFAULT_MAX_OUTPUT_TOKENS,
    extra_args: tuple[str, ...] = (),
    timeout: float = 180.0,
) -> Completed:
    """The real CLI, headless, in a bwrap sandbox that only reaches loopback (the adapter)."""
    binary = claude_cli.fetch()
    binds = {binary: claude_cli.SANDBOX_BINARY}
    sandbox = await BwrapSandbox.create(workdir, network="loopback", ro_binds=binds)
    try:
        cmd = claude_cli.build_command(
            prompt, model=MODEL, max_turns=max_turns, binary=claude_cli.SANDBOX_BINARY, extra_args=extra_args
        )
        full_env = claude_cli.build_env(
            base_url, token, model=MODEL, home=sandbox.home, max_output_tokens=max_output_tokens,
            extra={**SANDBOX_ENV, **(env or {})},
        )  # fmt: skip
        return await sandbox.run(cmd, full_env, timeout=timeout)
    finally:
        await sandbox.close()


async def rollout_events(bootstrap: str, namespace: str, topic: str, rollout_id: str) -> list[dict[str, Any]]:
    """The rollout's events on ``topic`` (base name), read back from the beginning in bus order."""
    plan = ReadPlan(topic_name(topic, namespace), "beginning", key=rollout_id.encode())
    records = []
    async for _, decoded in read(bootstrap, plan):
        if isinstance(decoded, Exception):
            raise decoded
        records.append(decoded.record)
    return records


def script_turns(script: Path, key: str = "turns") -> list[str]:
    """The raw model outputs of a script file's ``turns`` (or ``subagent_turns``)."""
    raw = json.loads(script.read_text())[key]
    return [t if isinstance(t, str) else t["text"] for t in raw]


CODEX_CATALOG = "/opt/codex/catalog.json"  # where the Codex sandbox mounts the model catalog


async def play_codex(
    rig: Rig,
    tmp_path: Path,
    prompt: str,
    *,
    token: str | None = None,
    rollout_id: str = "",
    extra_args: tuple[str, ...] = (),
    url: str = "",
) -> Rollout:
    """:func:`play` with the real Codex CLI (a ``codex`` session) instead of Claude Code; ``extra_args`` go
    on its command line (``-c key=value`` settings); ``url``: where it reaches the adapter, if not directly (a
    proxy in between)."""
    rollout_id = rollout_id or new_rollout_id()
    session_token = await rig.open_session(rollout_id, "codex") if token is None else token
    workdir = prepare_repo(EXAMPLES / "buggy_repo", tmp_path / rollout_id)
    completed = await run_codex(url or rig.url, session_token, workdir, prompt, extra_args=extra_args)
    (tmp_path / f"{rollout_id}.events.jsonl").write_text(completed.stdout)  # for a failure's post-mortem
    if token is None:
        await rig.close_session(rollout_id)
    turns = await rollout_events(rig.bootstrap, rig.namespace, "turns", rollout_id)
    sessions = await rollout_events(rig.bootstrap, rig.namespace, "sessions", rollout_id)
    return Rollout(rollout_id, completed, workdir, turns, sessions)


async def run_codex(
    base_url: str,
    token: str,
    workdir: Path,
    prompt: str,
    *,
    timeout: float = 180.0,
    extra_args: tuple[str, ...] = (),
) -> Completed:
    """The real Codex CLI, headless, in a bwrap sandbox that only reaches loopback (the adapter)."""
    codex_cli.fetch()
    binary, catalog = (
        codex_cli.execute_only_binary(),
        codex_cli.catalog_file(MODEL),
    )  # as the runner mounts it
    binds = {binary: codex_cli.SANDBOX_BINARY, catalog: CODEX_CATALOG}
    sandbox = await BwrapSandbox.create(workdir, network="loopback", ro_binds=binds)
    try:
        cmd = codex_cli.build_command(
            prompt, base_url=f"{base_url}/v1", model=MODEL, catalog=CODEX_CATALOG, workdir=sandbox.workdir,
            binary=codex_cli.SANDBOX_BINARY, tool_env=SANDBOX_ENV, extra_args=extra_args,
        )  # fmt: skip
        env = codex_cli.build_env(token, home=sandbox.home, extra=SANDBOX_ENV)
        secret = {codex_cli.TOKEN_ENV: env.pop(codex_cli.TOKEN_ENV)}  # as the runner hands it over
        return await sandbox.run(cmd, env, timeout=timeout, secret_env=secret)
    finally:
        await sandbox.close()
