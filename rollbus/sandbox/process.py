"""Run one host process to completion under a deadline, keeping its output even when it is killed.

``run_process`` returns once the output pipes are closed, i.e. once every process that inherited them has
exited: after a timeout kill that means the whole tree is gone, not just signalled. Only a process that
escaped the process group (its own POSIX session, outside any namespace) can hold them open; it is waited for
for at most ``KILL_GRACE_S``.

Output is bounded: past ``output_limit`` bytes a stream keeps its first and last halves and counts what it
dropped in between (an agent printing forever costs the host nothing but CPU). A caller that wants stdout's
bytes themselves (a patch) passes a :class:`CappedBytes`: the first ``limit`` bytes are kept, and one byte
more stops the process, so the host never holds more than the cap whatever the process writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from asyncio.subprocess import PIPE
from collections.abc import Callable, Mapping, Sequence

from rollbus.sandbox.base import Completed

KILL_GRACE_S = 5.0
READER_GRACE_S = 1.0
CHUNK = 1 << 16

Killer = Callable[[asyncio.subprocess.Process], None]
DEFAULT_OUTPUT_LIMIT = 8 << 20


class BoundedOutput:
    """The head and tail of a stream, at most ``limit`` bytes in all, and how much fell in between."""

    def __init__(self, limit: int) -> None:
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self._half = max(limit // 2, 1)

    def add(self, chunk: bytes) -> None:
        room = self._half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail += chunk
        excess = len(self.tail) - self._half
        if excess > 0:
            del self.tail[:excess]
            self.dropped += excess

    def text(self) -> str:
        marker = f"\n[... {self.dropped} bytes dropped ...]\n".encode() if self.dropped else b""
        return bytes(self.head + marker + self.tail).decode("utf-8", errors="replace")


class CappedBytes:
    """The first ``limit`` bytes of a stream, as bytes; ``overflowed`` once a byte more arrived."""

    def __init__(self, limit: int) -> None:
        self.data = bytearray()
        self.limit = limit
        self.overflowed = False

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.data)
        self.data += chunk[: max(room, 0)]
        self.overflowed = self.overflowed or len(chunk) > room


def kill_process_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the group the process leads (it was started in a new POSIX session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None,
    timeout: float,
    kill: Killer = kill_process_group,
    pass_fds: Sequence[int] = (),
    output_limit: int = DEFAULT_OUTPUT_LIMIT,
    preexec_fn: Callable[[], None] | None = None,
    stdout: CappedBytes | None = None,
    stdin: int | None = None,
) -> Completed:
    """Run ``argv`` in a new POSIX session; on timeout ``kill`` it (and its group) and report what it printed.

    ``preexec_fn`` runs in the child before exec (joining cgroups, dropping to the sandbox uid). With
    ``stdout``, standard output goes there (``Completed.stdout`` is empty) and overflowing it kills the
    process as a timeout would (``failure_kind`` ``output_truncated``). ``stdin``: a file descriptor to read
    from instead of /dev/null.
    """
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else stdin,
        stdout=PIPE,
        stderr=PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        pass_fds=tuple(pass_fds),
        preexec_fn=preexec_fn,
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err = BoundedOutput(output_limit), BoundedOutput(output_limit)

    def stop() -> None:
        kill(proc)
        kill_process_group(proc)

    read_out = _collect(proc.stdout, out) if stdout is None else _capture(proc.stdout, stdout, stop)
    read_err = _collect(proc.stderr, err)
    readers: list[asyncio.Future[None]] = [asyncio.ensure_future(read_out), asyncio.ensure_future(read_err)]
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout)  # on 3.11 this also waits for the pipes to close
    except TimeoutError:
        timed_out = True
        kill(proc)
        kill_process_group(proc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
    except asyncio.CancelledError:
        kill(proc)
        kill_process_group(proc)
        raise
    finally:
        await _stop(readers)
    dropped = out.dropped + err.dropped
    truncated = dropped or (stdout is not None and stdout.overflowed)
    return Completed(
        exit_code=proc.returncode if proc.returncode is not None else -signal.SIGKILL,
        stdout=out.text(),
        stderr=err.text(),
        wall_time_s=time.monotonic() - start,
        timed_out=timed_out,
        failure_kind="timeout" if timed_out else "output_truncated" if truncated else None,
        output_dropped=dropped,
    )


async def _collect(stream: asyncio.StreamReader, sink: BoundedOutput) -> None:
    """Add everything read to ``sink`` as it arrives, so a cancelled read keeps what came before."""
    while chunk := await stream.read(CHUNK):
        sink.add(chunk)


async def _capture(stream: asyncio.StreamReader, sink: CappedBytes, stop: Callable[[], None]) -> None:
    """Fill ``sink``; at its first byte too many, stop the writer and discard the rest until end of file.

    Draining matters: a stream nobody reads pauses its pipe once asyncio's buffer fills, the pipe's end of
    file is then never seen, and ``proc.wait()`` (which waits for the pipes too) would sit until the timeout.
    """
    while chunk := await stream.read(CHUNK):
        sink.add(chunk)
        if sink.overflowed:
            stop()
            while await stream.read(CHUNK):
                pass
            return


async def _stop(readers: list[asyncio.Future[None]]) -> None:
    """Readers end at end of file; one still blocked on a pipe that a stray process holds is cancelled."""
    _, pending = await asyncio.wait(readers, timeout=READER_GRACE_S)
    for reader in pending:
        reader.cancel()
    await asyncio.gather(*readers, return_exceptions=True)
