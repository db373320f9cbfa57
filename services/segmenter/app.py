"""The segmenter as a Faust app: one handler of the four co-partitioned topics, state in two tables.

Why it is shaped like this (Faust facts it respects):

* ``Stream.join`` is not implemented, so one handler (one message at a time, the only writer of the tables)
  reads ``turns``, ``sessions``, ``diffs``, ``rewards`` and an internal ``segmenter-ticks`` topic, and drives
  :class:`rollbus.segmentation.Segmenter`, the same state machine ``rollbus rebuild segments`` and the
  tests use. ``rollouts`` (rollout id -> small JSON state) is the state machine; ``turn-bodies`` holds each
  trainable turn once, as the bytes published (the prompt-reference encoding), so changelog bytes grow
  with tokens, not with their square. Values are always assigned whole; bodies are deleted once the
  rollout's segments are out. Both tables are written through a :class:`ChangelogBuffer`: the local
  store at once, the changelog once per key per commit (its latest value), like Kafka Streams' cache.
* Faust writes a table change to the changelog partition of the event being processed; every input has
  the same partition count and murmur2 keys by rollout id, so a rollout's state, bodies and events share
  one partition number everywhere, and a rebalanced or restarted worker recovers exactly its rollouts.
  ``rollbus segmenter`` refuses to start when counts differ (see ``main.preflight``).
* ``processing_guarantee="at_least_once"``, never Faust's ``exactly_once``: segments are sent and their
  acks awaited *before* the rollout is marked emitted, segment ids are deterministic, and consumers
  deduplicate by id. A crash anywhere re-cuts identical segments or none.
* Faust's commit flushes its producer buffer with 0.1 s of patience and commits the offsets even when table
  writes are still queued; :func:`commit_after_changelogs` makes every commit wait for the acks of all table
  writes made so far, so a ``kill -9`` never leaves a committed event whose state change was never logged.
* Timers cannot write tables, so the leader's timer publishes one tick per partition to
  ``segmenter-ticks``; the handler takes a tick like any event of that partition and aborts rollouts idle
  past the timeout there. Ticks are kept, so a rebuild replays the same aborts. The segmenter finds due
  rollouts through an in-memory clock index of the states it wrote; each assignment resets it (recovery
  rewrites the table), and the next tick rebuilds it from the table.
* Faust's consumer fetches with aiokafka's one-byte minimum: a fetch round trip per event or two under a
  trickle. :func:`~services.segmenter.delivery.batched_fetches` gives it ``--fetch-min-bytes`` and
  ``--fetch-max-wait``.
* The handler is not an agent: :func:`~services.segmenter.delivery.handle_inline` gives it each input in
  the fetcher's own hand-over and acks the message when it returns (an agent's stream, its queue, its
  event and its sensors: a no-op worker took 130-140 µs of CPU an event through an agent, 80-90 inline), and
  :func:`~services.segmenter.delivery.quick_delivery` runs every hand-over without Faust's four tasks a
  message. Table changelogs still reach Faust's recovery through its conductor.
* Faust loses messages in two places when partitions move (seen with a second worker joining, then the first
  leaving): the end of a recovery seeks the streams with the flow on and then empties their queues, and a
  batch fetched as a rebalance stops the flow is dropped with only the streams sought back (changelogs have
  no committed offset: the recovery then waits forever). :func:`~services.segmenter.delivery.
  seek_before_streams_resume` and :func:`~services.segmenter.delivery.rewind_changelogs_on_seek` close both.
  The seek that follows a dropped batch also leaves an input partition never committed where the fetcher
  had got to (aiokafka seeks only committed offsets above 0): :func:`~services.segmenter.delivery.
  rewind_uncommitted_on_seek` starts such a partition again from its beginning.
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

from rollbus.bus import dead_letter
from rollbus.codec import CodecError, encode
from rollbus.segmentation import Outcome, Segmenter, decode_fact
from rollbus.topics import DEAD_LETTER_MAX_BYTES, MAX_EVENT_BYTES, dead_letters_for, topic_name
from services.segmenter.changelog import ChangelogBuffer, handling
from services.segmenter.delivery import (
    batched_fetches,
    handle_inline,
    quick_delivery,
    rewind_changelogs_on_seek,
    rewind_uncommitted_on_seek,
    seek_before_streams_resume,
)
from services.segmenter.settings import SegmenterSettings

log = logging.getLogger("rollbus.segmenter")
SERVICE = "segmenter"
INPUTS = ("turns", "sessions", "diffs", "rewards")
TICKS = "segmenter-ticks"
TABLES = ("rollouts", "turn-bodies")


def app_id(namespace: str) -> str:
    """The consumer group and the prefix of the changelog topics: one per namespace."""
    return topic_name("rollbus-segmenter", namespace)


def internal_topics(namespace: str) -> list[str]:
    """Topics the app creates itself, which must share the inputs' partition count."""
    return [topic_name(TICKS, namespace)] + [f"{app_id(namespace)}-{t}-changelog" for t in TABLES]


def broker_urls(bootstrap_servers: str) -> list[str]:
    return [f"kafka://{host.strip()}" for host in bootstrap_servers.split(",") if host.strip()]


def build_app(settings: SegmenterSettings, partitions: int) -> faust.App:
    """The Faust app: tables, inline handler, tick timer; ``partitions`` is the inputs' common count."""
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
        consumer_max_fetch_size=MAX_EVENT_BYTES * 2,
        table_cleanup_interval=3600.0,
    )
    big = {"max.message.bytes": str(MAX_EVENT_BYTES + 64 * 1024)}
    states = app.Table(
        "rollouts", key_type=str, value_type=bytes, partitions=partitions, extra_topic_configs=big
    )
    bodies = app.Table(
        "turn-bodies", key_type=str, value_type=bytes, partitions=partitions, extra_topic_configs=big
    )
    for table in (states, bodies):  # values are our own bytes (JSON state, Avro turns): no Faust codec
        table.key_serializer = table.value_serializer = "raw"  # Faust derives "json" from non-model types
        table.changelog_topic = table._new_changelog_topic()  # ...and would recover with it otherwise
    buffers = (ChangelogBuffer(states), ChangelogBuffer(bodies))
    # A commit hands the buffers' changes to Faust's producer buffer at once (a key each, ~2 per rollout in
    # flight); past its default of 100 queued messages Faust stops the hand-overs and warns until it ebbs.
    app.producer.buffer.max_messages = 10_000
    batched_fetches(app.consumer, settings.fetch_min_bytes, settings.fetch_max_wait)  # not a fetch an event
    delivery_idle = quick_delivery(app.consumer)  # each message handed over without four Faust tasks
    seek_before_streams_resume(app, delivery_idle)  # ...and none is lost when a rebalance resumes the streams
    rewind_changelogs_on_seek(app)  # ...or when a fetch comes back after a rebalance stopped the flow
    handled = [topic_name(t, ns) for t in (*INPUTS, TICKS)]
    rewind_uncommitted_on_seek(app.consumer, handled)  # ...on a partition never committed too
    commit_after_changelogs(app, buffers, settings.changelog_timeout)
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    ticks = app.topic(topic_name(TICKS, ns), partitions=partitions, internal=True, **raw)
    segments = app.topic(topic_name("segments", ns), **raw)
    letters = app.topic(dead_letters_for(topic_name("segments", ns)), **raw)
    segmenter = Segmenter(*buffers, settings.options())
    worker = SegmenterHandler(segmenter, segments, letters, topic_name(TICKS, ns), app.crash)

    # No agent: the fetcher hands each input straight to the worker (one at a time: the tables' only
    # writer); the channel is only added so that the conductor subscribes the consumer to its topics.
    app.topics.add(app.topic(*handled, **raw))
    handle_inline(app, handled, worker.handle_or_crash)

    @app.timer(settings.tick_interval, on_leader=True)
    async def tick() -> None:
        now = json.dumps({"now": int(time.time() * 1000)}).encode()
        for partition in range(partitions):
            await ticks.send(key=b"tick", value=now, partition=partition)

    @app.on_partitions_assigned.connect
    async def reindex(sender: Any, assigned: Any, **kwargs: Any) -> None:
        """Changelog recovery may now rewrite the tables: the tick's clock index is rebuilt from them."""
        segmenter.reindex()

    app.segmenter = segmenter  # type: ignore[attr-defined]
    return app


def commit_after_changelogs(app: faust.App, buffers: tuple[ChangelogBuffer, ...], timeout: float) -> None:
    """Make the flush that precedes every offset commit log the ``buffers``' changes, then wait for their
    tables' changelog acks.

    Why: ``ProducerBuffer.flush`` returns when one queued message takes over 0.1 s to hand over, and the
    consumer then commits (faust/transport/consumer.py ``_commit_offsets``). A table write still queued at a
    crash would be lost while the event that made it counts as processed: its rollout would never close.
    Waiting for the writes' own futures (resolved by the broker's ack, failed by a send error) closes that
    hole; a write that fails or outlasts ``timeout`` fails the commit, so the worker stops uncommitted.
    """
    pending: set[asyncio.Future[Any]] = set()
    for table in (buffer.table for buffer in buffers):
        send = table.send_changelog

        def tracked(*args: Any, _send: Any = send, **kwargs: Any) -> Any:
            written = _send(*args, **kwargs)
            pending.add(written)
            written.add_done_callback(pending.discard)
            return written

        table.send_changelog = tracked
    producer = app.producer
    flush = producer.flush

    async def flush_then_wait_for_changelogs() -> None:
        for buffer in buffers:  # the offsets to commit were chosen before this: their changes are all here
            buffer.flush()
        await flush()
        if pending:
            await asyncio.wait_for(asyncio.gather(*pending), timeout)

    producer.flush = flush_then_wait_for_changelogs  # type: ignore[method-assign]


class SegmenterHandler:
    """What the worker does with one message: tick, poison, or fact; outputs acked before settling."""

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
        self._last_report = 0.0

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
        with handling(message.partition):  # table changes are logged to the message's partition
            await self._handle(message)

    async def _handle(self, message: Any) -> None:
        if message.topic == self.ticks_topic:
            self.tick(message)
            return
        timestamp = int(message.timestamp * 1000)
        try:
            fact = decode_fact(message.topic, message.value, message.key, timestamp)
        except CodecError as poison:
            self.segmenter.count("poison")
            await self.dead_letter(message, poison)
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

    async def publish(self, outcome: Outcome) -> None:
        """Send the segments and wait for every ack: only then may the rollout be marked emitted."""
        if not outcome.messages:
            return
        key = outcome.rollout_id.encode()
        sent = [await self.segments.send(key=key, value=segment, force=True) for segment in outcome.messages]
        await asyncio.gather(*sent)
        log.info("rollout %s: %d segment(s) out", outcome.rollout_id, len(outcome.messages))

    async def dead_letter(self, message: Any, error: Exception) -> None:
        record = dead_letter(message, error, SERVICE)
        await (await self.letters.send(key=message.key, value=encode("dead_letter", record), force=True))
        log.warning("dead letter from %s[%d]@%d: %s", message.topic, message.partition, message.offset, error)

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
        if aborted or time.monotonic() - self._last_report > 5:  # an abort's count is shown with it
            self._last_report = time.monotonic()
            log.info("counts %s", json.dumps(self.segmenter.counts, sort_keys=True))


class Rejected(Exception):
    """A well-formed event the state machine refused (conflict, late, second reward): the reason says why."""
