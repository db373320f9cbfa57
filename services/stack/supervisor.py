"""Supervise a stack of rollbus services as child processes: start together, restart on crash, stop cleanly.

Every child starts at once, except one that names others in ``after``: it starts once they are ready. Start-up
is mostly imports (torch, transformers) and model loads, so the stack is up in about its slowest child's
time, not the sum of all.

Each child runs in a session of its own, so stopping one stops everything it started (the adapter's engine
calls, the runner's sandboxes). A child that exits while the stack is up is restarted after a backoff that
doubles up to a cap and resets once the child has stayed up for a while. Stopping (Ctrl-C, SIGTERM, or an
error during start-up) stops the children all at once: SIGTERM to each whole process group, then SIGKILL
after a grace period, so nothing is left behind whatever moment the stop came.

The broker the services talk to may be watched too (``broker=``): it is not a child (it outlives a stack
stopped on purpose, and is started and stopped by whoever owns it), but if it dies while the stack is up it is
started again, on its own data and port, before anything else; children that exited meanwhile (every client
of a dead broker may) wait for it, then restart at once instead of after the backoff their crashes built up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import httpx
import psutil

log = logging.getLogger("rollbus.stack")


class StackFailed(RuntimeError):
    """A service did not become ready, or kept crashing past its restart budget."""


class Broker(Protocol):
    """What the supervisor needs of a broker it watches (:class:`rollbus.kafka.broker.EmbeddedBroker`)."""

    @property
    def bootstrap_servers(self) -> str: ...

    def is_running(self) -> bool: ...

    def start(self, timeout: float = ...) -> float: ...


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the stack: its command, and how to tell it is ready."""

    name: str
    argv: Sequence[str]
    health_url: str | None = None  # ready when it answers 200; None: ready once alive for `settle` seconds
    settle: float = 1.0
    env: dict[str, str] = field(default_factory=dict)
    restart: Literal["always", "on-failure"] = "always"  # on-failure: a clean exit (0) means done
    after: tuple[str, ...] = ()  # services that must be ready before this one starts

    @classmethod
    def rollbus(cls, name: str, args: Sequence[str], **kwargs: object) -> ServiceSpec:
        """``python -m rollbus <name> <args>``, exactly as a user would start it."""
        # the other fields' keywords, passed through as given
        return cls(name, [sys.executable, "-m", "rollbus", name, *args], **kwargs)  # type: ignore[arg-type]


@dataclass
class Child:
    spec: ServiceSpec
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = 0.0
    restart_at: float | None = None  # exited: when it may start again

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def done(self) -> bool:
        """Finished for good: an on-failure service that exited cleanly."""
        return self.spec.restart == "on-failure" and self.proc is not None and self.proc.poll() == 0

    def launch(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                list(self.spec.argv), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.spec.env},
            )  # fmt: skip
        self.started_at, self.restart_at = time.monotonic(), None

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the child's process group, SIGKILL whatever of it is left after ``grace`` seconds."""
    if proc.poll() is not None and not _group_alive(proc.pid):
        return
    members = _group_members(proc.pid)
    _signal_group(proc.pid, signal.SIGTERM)
    _, alive = psutil.wait_procs(members, timeout=grace)
    if alive or proc.poll() is None:
        _signal_group(proc.pid, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a kernel that will not reap
        log.error("process %d did not exit after SIGKILL", proc.pid)


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for candidate in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(candidate.pid) == pgid:
                members.append(candidate)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return members


def _group_alive(pgid: int) -> bool:
    return bool(_group_members(pgid))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Supervisor:
    """Runs ``specs`` until :meth:`stop`; restarts crashed children with capped backoff."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        log_dir: Path,
        *,
        ready_timeout: float = 120.0,
        stop_grace: float = 20.0,
        backoff_initial: float = 1.0,
        backoff_max: float = 30.0,
        stable_after: float = 60.0,
        max_restarts: int = 20,
        on_event: Callable[[str, str], None] | None = None,
        broker: Broker | None = None,
    ) -> None:
        self.children = [Child(spec, Path(log_dir) / f"{spec.name}.log") for spec in specs]
        self.ready_timeout, self.stop_grace = ready_timeout, stop_grace
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.stable_after, self.max_restarts = stable_after, max_restarts
        self.on_event = on_event or (lambda name, what: log.info("%s: %s", name, what))
        self._stopping = asyncio.Event()
        self.broker = broker
        self.broker_restarts = 0
        self._broker_started = time.monotonic()
        self._broker_starting: asyncio.Task[float] | None = None

    def __getitem__(self, name: str) -> Child:
        return next(child for child in self.children if child.spec.name == name)

    async def start(self) -> None:
        """Start every child (each once those it comes ``after`` are ready) and wait until all are ready; on
        any failure, or a cancel, stop what started."""
        ready = {child.spec.name: asyncio.Event() for child in self.children}

        async def start_one(child: Child) -> None:
            for name in child.spec.after:
                await ready[name].wait()
            child.launch()
            await self._wait_ready(child)
            self.on_event(child.spec.name, "ready")
            ready[child.spec.name].set()

        tasks = [asyncio.create_task(start_one(child)) for child in self.children]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if (failure := task.exception()) is not None:
                    raise failure
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.stop()
            raise

    async def _wait_ready(self, child: Child) -> None:
        deadline = time.monotonic() + self.ready_timeout
        async with httpx.AsyncClient(timeout=2.0) as http:
            while time.monotonic() < deadline:
                if not child.running:
                    raise StackFailed(f"{child.spec.name} exited during start-up:\n{child.log_tail()}")
                if child.spec.health_url is None:
                    if time.monotonic() - child.started_at >= child.spec.settle:
                        return
                else:
                    try:
                        if (await http.get(child.spec.health_url)).status_code == 200:
                            return
                    except httpx.TransportError:
                        pass
                await asyncio.sleep(0.2)
        waited = f"{self.ready_timeout:.0f}s"
        raise StackFailed(f"{child.spec.name} was not ready in {waited}:\n{child.log_tail()}")

    async def watch(self, poll: float = 0.5) -> None:
        """Until stopped: restart a dead broker first, then any child that exited, each after its own
        backoff (one child backing off delays no other); give up past ``max_restarts`` crashes in a row (a
        child that stayed up ``stable_after`` seconds starts counting afresh)."""
        while not self._stopping.is_set():
            if self.broker is not None and not self.broker.is_running():
                await self._restart_broker()
                continue
            if time.monotonic() - self._broker_started > self.stable_after:
                self.broker_restarts = 0
            for child in self.children:
                if child.done or self._stopping.is_set():
                    continue
                if child.running:
                    if time.monotonic() - child.started_at > self.stable_after:
                        child.backoff, child.restarts = 0.0, 0  # it stayed up: a new crash starts afresh
                    continue
                self._restart(child)
            await self._pause(poll)

    def _restart(self, child: Child) -> None:
        """A dead child: note when it may start again (its backoff), or start it if that time has come."""
        if child.restart_at is None:
            code = child.proc.returncode if child.proc else None
            if child.restarts >= self.max_restarts:
                last = child.log_tail()
                raise StackFailed(f"{child.spec.name} crashed {child.restarts} times; last:\n{last}")
            child.backoff = min(self.backoff_max, child.backoff * 2 or self.backoff_initial)
            child.restart_at = time.monotonic() + child.backoff
            self.on_event(child.spec.name, f"exited with {code}; restarting in {child.backoff:.1f}s")
        if time.monotonic() >= child.restart_at:
            child.restarts += 1
            child.launch()
            self.on_event(child.spec.name, f"restarted ({child.restarts})")

    async def _restart_broker(self) -> None:
        """Start the dead broker again (same data, same port: the children's addresses stay true); on
        success every child's backoff is reset, so those that died with it come back at once."""
        assert self.broker is not None
        if self.broker_restarts >= self.max_restarts:
            raise StackFailed(f"the broker died {self.broker_restarts} times; it is not restarted again")
        self.broker_restarts += 1
        self.on_event("broker", f"not running; starting it again on {self.broker.bootstrap_servers}")
        # a task of its own, awaited by stop(): a start cut short by a cancel would leave a JVM behind
        self._broker_starting = asyncio.create_task(asyncio.to_thread(self.broker.start, self.ready_timeout))
        try:
            seconds = await asyncio.shield(self._broker_starting)
        except Exception as error:  # noqa: BLE001 - any failed start is retried, up to the budget
            self.on_event("broker", f"did not start again: {error}")
            await self._pause(min(self.backoff_max, self.backoff_initial * 2**self.broker_restarts))
            return
        self.on_event("broker", f"restarted ({self.broker_restarts}), ready in {seconds:.1f}s")
        self._broker_started = time.monotonic()
        for child in self.children:
            child.backoff = 0.0
            if not child.running and not child.done:
                child.restart_at = time.monotonic()
                self.on_event(child.spec.name, "exited while the broker was away; restarting now")

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def stop(self) -> None:
        """Stop every child, all at once (each stops in its own grace period, not after the others); safe to
        call more than once and at any moment."""
        self._stopping.set()
        if self._broker_starting is not None:  # let a restart in flight finish: its owner stops the broker
            await asyncio.gather(self._broker_starting, return_exceptions=True)
        running = [child.proc for child in self.children if child.proc is not None]
        await asyncio.gather(*(asyncio.to_thread(stop_group, proc, self.stop_grace) for proc in running))

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
