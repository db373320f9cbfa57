"""The segmenter as a Faust app: one agent over the four co-partitioned topics, state in two tables.

Why it is shaped like this (Faust facts it respects):

* ``Stream.join`` is not implemented, so one agent (concurrency 1, the only writer of the tables) reads
  ``turns``, ``sessions``, ``diffs``, ``rewards`` and an internal ``segmenter-ticks`` topic, and drives
  :class:`rollbus.services.segmenter.segmentation.Segmenter`, the same state machine ``rollbus rebuild
  segments`` and the tests use. ``rollouts`` (rollout id -> small JSON state) is the state machine;
  ``turn-bodies`` holds each trainable turn once, as the bytes published (the prompt-reference encoding), so
  changelog bytes grow with tokens, not with their square. Values are always assigned whole; bodies are
  deleted once the rollout's segments are out.
* Faust writes a table change to the changelog partition of the event being processed; every input has
  the same partition count and murmur2 keys by rollout id, so a rollout's state, bodies and events share
  one partition number everywhere, and a rebalanced or restarted worker recovers exactly its rollouts.
  ``rollbus segmenter`` refuses to start when counts differ (see ``main.preflight``).
* ``processing_guarantee="at_least_once"``, never Faust's ``exactly_once``: segments are sent and their
  acks awaited *before* the rollout is marked emitted, segment ids are deterministic, and consumers
  deduplicate by id. A crash anywhere re-cuts identical segments or none.
* Timers cannot write tables, so the leader's timer publishes one tick per partition to
  ``segmenter-ticks``; the agent takes a tick like any event of that partition and aborts rollouts idle
  past the timeout there. Ticks are kept, so a rebuild replays the same aborts. The segmenter finds due
  rollouts through an in-memory clock index of the states it wrote; each assignment resets it (recovery
  rewrites the table), and the next tick rebuilds it from the table.
* Faust and aiokafka lose data in four places (a commit before the table writes are acked, and three
  seeks around a rebalance); :mod:`rollbus.services.segmenter.upstream_fixes` closes them, and refuses
  versions of those libraries it was not proven against.
* Poison bytes (undecodable, wrong type, wrong key, oversized) go to ``dead-letters`` with the original
  bytes and the reason, and processing continues.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import faust

from rollbus.kafka.dead_letters import DeadLetters
from rollbus.kafka.topics import DEAD_LETTER_MAX_BYTES, MAX_EVENT_BYTES, dead_letters_for, topic_name
from rollbus.services.segmenter import upstream_fixes
from rollbus.services.segmenter.segmentation import Handled, Segmenter, decode_fact
from rollbus.services.segmenter.settings import SegmenterSettings

log = logging.getLogger("rollbus.segmenter")
SERVICE = "segmenter"
INPUTS = ("turns", "sessions", "diffs", "rewards")
TICKS = "segmenter-ticks"
TABLES = ("rollouts", "turn-bodies")
RAW: dict[str, Any] = {
    "key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"
}  # fmt: skip


def app_id(namespace: str) -> str:
    """The consumer group and the prefix of the changelog topics: one per namespace."""
    return topic_name("rollbus-segmenter", namespace)


def internal_topics(namespace: str) -> list[str]:
    """Topics the app creates itself, which must share the inputs' partition count."""
    return [topic_name(TICKS, namespace)] + [changelog_name(namespace, t) for t in TABLES]


def changelog_name(namespace: str, table: str) -> str:
    return f"{app_id(namespace)}-{table}-changelog"  # Faust's name for a table's changelog


def broker_urls(bootstrap_servers: str) -> list[str]:
    return [f"kafka://{host.strip()}" for host in bootstrap_servers.split(",") if host.strip()]


def build_app(settings: SegmenterSettings, partitions: int) -> faust.App:
    """The Faust app with its tables, agent and tick timer; ``partitions`` is the inputs' common count."""
    ns = settings.namespace
    datadir = settings.state_dir / "segmenter" / (ns or "default")
    datadir.parent.mkdir(parents=True, exist_ok=True)
    app = faust.App(
        app_id(ns),
        broker=broker_urls(settings.bootstrap_servers),
        store=settings.store,
        processing_guarantee="at_least_once",
        topic_partitions=partitions,
        topic_replication_factor=1,
        topic_allow_declare=True,
        web_enabled=False,
        datadir=str(datadir),
        broker_commit_interval=settings.commit_interval,
        broker_session_timeout=settings.session_timeout,
        broker_heartbeat_interval=settings.session_timeout / 10,
        consumer_auto_offset_reset="earliest",
        producer_max_request_size=DEAD_LETTER_MAX_BYTES + 64 * 1024,
        # every table write is a changelog message (turn bodies are as large as the turns): aiokafka's 16 KiB
        # batches, one request in flight, held the writes to one round trip per 16 KiB and partition
        producer_max_batch_size=2**20,
        producer_linger=0.005,
        consumer_max_fetch_size=MAX_EVENT_BYTES * 2,
        table_cleanup_interval=3600.0,
    )
    states, bodies = (table(app, ns, name, partitions) for name in TABLES)
    # Each table write is queued in Faust's producer buffer; past its default of 100 queued messages Faust
    # stops feeding the agent and warns until it ebbs, which a burst of turn bodies reaches.
    app.producer.buffer.max_messages = 10_000
    handled = [topic_name(t, ns) for t in (*INPUTS, TICKS)]
    upstream_fixes.install(app, (states, bodies), handled, settings.changelog_timeout)
    ticks = app.topic(topic_name(TICKS, ns), partitions=partitions, internal=True, **RAW)
    segments = app.topic(topic_name("segments", ns), **RAW)
    letters = app.topic(dead_letters_for(topic_name("segments", ns)), **RAW)
    segmenter = Segmenter(states, bodies, settings.options())
    worker = SegmenterHandler(segmenter, segments, letters, topic_name(TICKS, ns), app.crash)

    @app.agent(app.topic(*handled, **RAW), concurrency=1)
    async def segment(stream: Any) -> None:
        async for event in stream.events():  # acked when the next is taken: a crash leaves it uncommitted
            await worker.handle_or_crash(event.message)

    @app.timer(settings.tick_interval, on_leader=True)
    async def tick() -> None:
        now = json.dumps({"now": int(time.time() * 1000)}).encode()
        for partition in range(partitions):
            await ticks.send(key=b"tick", value=now, partition=partition)

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]  # faust awaits async receivers; its types say sync
    async def reindex(sender: Any, assigned: Any, **kwargs: Any) -> None:
        """Changelog recovery may now rewrite the tables: the tick's clock index is rebuilt from them."""
        segmenter.reindex()

    app.segmenter = segmenter  # type: ignore[attr-defined]  # faust's App takes attributes; tests reach it
    return app


def table(app: faust.App, namespace: str, name: str, partitions: int) -> Any:
    """A table of our own bytes (JSON states, Avro turns) by rollout-derived ``str`` keys, logged raw.

    Faust derives a ``json`` key codec from ``key_type=str``; the changelog is given here instead, raw both
    ways, so its records are the keys' and values' own bytes (and recovery reads back ``str`` keys)."""
    big = {"max.message.bytes": str(MAX_EVENT_BYTES + 64 * 1024)}
    codecs: dict[str, Any] = {
        "key_type": str, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"
    }  # fmt: skip
    changelog = app.topic(
        changelog_name(namespace, name), **codecs, partitions=partitions, compacting=True, acks=False,
        internal=True, config=big, maxsize=131_072, allow_empty=True,
    )  # fmt: skip
    created = app.Table(
        name, key_type=str, value_type=bytes, partitions=partitions, changelog_topic=changelog,
        extra_topic_configs=big,
    )  # fmt: skip
    # what its writes and its store encode with (attributes of the faust.Table made, which TableT leaves out)
    created.key_serializer = created.value_serializer = "raw"  # type: ignore[attr-defined]
    return created


class SegmenterHandler:
    """What the agent does with one message: tick, poison, or fact; outputs acked before settling."""

    def __init__(
        self,
        segmenter: Segmenter,
        segments: Any,
        letters: Any,
        ticks_topic: str,
        crash: Callable[[BaseException], Awaitable[None]] | None = None,
    ) -> None:
        self.segmenter, self.segments, self.letters, self.ticks_topic = (
            segmenter,
            segments,
            letters,
            ticks_topic,
        )
        self.crash = crash
        self.last_report = 0.0
        self.dead_letters = DeadLetters(SERVICE, self._send_letter)

    async def handle_or_crash(self, message: Any) -> None:
        """:meth:`handle`; if the bus fails it (a send, an ack), the worker stops with the message
        uncommitted, to be handled again after the restart."""
        try:
            await self.handle(message)
        except Exception as error:
            log.exception("segmenter stops: %s", error)
            if self.crash is not None:
                await self.crash(error)
            raise

    async def handle(self, message: Any) -> None:
        if message.topic == self.ticks_topic:
            self.tick(message)
            return
        timestamp = int(message.timestamp * 1000)
        fact = await self.dead_letters.decoded(
            message, lambda m: decode_fact(m.topic, m.value, m.key, timestamp)
        )
        if fact is None:
            self.segmenter.count("poison")
            return
        try:
            outcome = self.segmenter.handle(fact, bytes(message.value), message.partition)
        except Exception as bug:  # an input the state machine cannot take: keep it, say why, go on
            log.exception("cannot handle %s[%d]@%d", message.topic, message.partition, message.offset)
            self.segmenter.count("internal_error")
            await self.dead_letter(message, bug)
            return
        if outcome.dead_letter:
            await self.dead_letter(message, Rejected(outcome.dead_letter))
        await self.publish(outcome)
        self.segmenter.settle(outcome)

    async def publish(self, outcome: Handled) -> None:
        """Send the segments and wait for every ack: only then may the rollout be marked emitted."""
        if not outcome.messages:
            return
        key = outcome.rollout_id.encode()
        sent = [await self.segments.send(key=key, value=segment, force=True) for segment in outcome.messages]
        await asyncio.gather(*sent)
        log.info("rollout %s: %d segment(s) out", outcome.rollout_id, len(outcome.messages))

    async def dead_letter(self, message: Any, error: Exception) -> None:
        await self.dead_letters.letter(message, error)

    async def _send_letter(self, topic: str, value: bytes, key: bytes | None) -> object:
        """The namespace's dead-letters (``topic``) through Faust's producer, as its ``letters`` topic."""
        return await (await self.letters.send(key=key, value=value, force=True))

    def tick(self, message: Any) -> None:
        try:
            now = int(json.loads(message.value)["now"])
        except (ValueError, KeyError, TypeError):
            log.warning(
                "ignoring a malformed tick at %s[%d]@%d", message.topic, message.partition, message.offset
            )
            return
        aborted = self.segmenter.tick(now, message.partition)
        for state in aborted:
            log.warning("rollout %s aborted, nothing trainable: %s", state.rollout_id, state.reason)
        if aborted or time.monotonic() - self.last_report > 5:  # an abort's count is shown with it
            self.last_report = time.monotonic()
            log.info("counts %s", json.dumps(self.segmenter.counts, sort_keys=True))


class Rejected(Exception):
    """A well-formed event the state machine refused (conflict, late, second reward): the reason says why."""
