"""Running the real segmenter (``python -m rollbus segmenter``, a Faust worker) against the test broker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rollbus.codec import decode
from rollbus.kafka import clients
from rollbus.kafka.bus import Publisher
from rollbus.kafka.topics import split_name

Event = tuple[str, dict[str, Any]]


class SegmenterProcess:
    """One ``rollbus segmenter`` worker in its own process group, logging to a file."""

    def __init__(
        self, bootstrap: str, namespace: str, state_dir: Path, *extra: str, name: str = "w1"
    ) -> None:
        self.log_path = state_dir / f"segmenter-{name}.log"
        self.args = [
            sys.executable, "-m", "rollbus", "segmenter", "--bootstrap-servers", bootstrap,
            "--namespace", namespace, "--state-dir", str(state_dir / name), "--tick-interval", "1",
            "--commit-interval", "0.2", "--session-timeout", "6", *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SegmenterProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ.copy()
            )
        return self

    def kill(self) -> None:
        """``kill -9``: no shutdown, no commit, no flush."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> SegmenterProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def namespace_of(topics: dict[str, str]) -> str:
    return split_name(topics["turns"])[0]


async def publish(bootstrap: str, topics: dict[str, str], events: Iterable[Event]) -> None:
    async with Publisher(bootstrap, client_id="segmenter-test") as publisher:
        for topic, record in events:
            await publisher.publish(topics[topic], record)


async def read_all(
    bootstrap: str, topic: str, *, until: int | None = None, timeout: float = 60.0, worker: Any = None
) -> list[Any]:
    """Decoded records of ``topic`` from the beginning: once ``until`` distinct ones arrived (a segment counts
    once per id: after a crash its duplicates are no progress), then on to the log's end as it is then, so
    that duplicates written meanwhile show; or, with ``until`` None, to the log's end now. Fails fast if
    ``worker`` died."""
    consumer = clients.consumer(bootstrap, topic, client_id="test-read", auto_offset_reset="earliest")
    await consumer.start()
    records: list[Any] = []
    deadline = time.monotonic() + timeout

    async def fetch() -> None:
        if worker is not None and worker.proc.poll() is not None:
            exited = f"the segmenter exited with {worker.proc.returncode}"
            raise AssertionError(f"{exited}:\n{worker.log()[-3000:]}")
        batch = await consumer.getmany(timeout_ms=300)
        records.extend(decode(m.value).record for messages in batch.values() for m in messages)

    try:
        while until is not None and distinct(records) < until and time.monotonic() < deadline:
            await fetch()
        while not consumer.assignment() and time.monotonic() < deadline:
            await fetch()
        end = await consumer.end_offsets(list(consumer.assignment()))
        while time.monotonic() < deadline and [tp for tp in end if await consumer.position(tp) < end[tp]]:
            await fetch()
    finally:
        await consumer.stop()
    return records


def distinct(records: list[Any]) -> int:
    """How many records differ: segments by id, anything else each."""
    return len({record.get("segment_id", index) for index, record in enumerate(records)})


def unique_segments(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What a consumer deduplicating by segment id keeps (and a check that duplicates are identical)."""
    kept: dict[str, dict[str, Any]] = {}
    for record in records:
        first = kept.setdefault(record["segment_id"], record)
        assert first == record, f"segment {record['segment_id']} was emitted twice with different content"
    return kept
