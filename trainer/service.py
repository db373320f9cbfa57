"""Rank 0 of the trainer: consume ``segments``, step on complete groups, checkpoint, publish, commit.

The order of one step is the whole durability argument:

1. take the first ``rollout_batch_size`` complete groups (in the order they completed in the log);
2. train them (every rank its share);
3. write checkpoint ``v<N>`` atomically: weights, optimiser, and the finished groups (of the last
   ``--forget-finished-after`` seconds);
4. publish the step's fact to ``train-steps`` (the groups and segments it trained, tokens, loss, mismatch,
   staleness), then version N to ``policy``, and ask the engine to load it;
5. commit, per partition, the first offset that still has an untrained segment behind it.

The PNG of the metrics is redrawn after that, in a thread of its own: it is a view of ``metrics.jsonl``, not
part of a step, and matplotlib costs seconds the engine would otherwise wait for its weights.

A kill before 3 loses the step's in-memory work only: the offsets were not committed, the segments come back.
A kill between 3 and 5 leaves a checkpoint whose finished groups make the redelivered segments *late*, so they
are dropped, not trained twice; the restart republishes the fact and N (from the checkpoint) if N is not on
``policy``. So a version on ``policy`` always has its step's fact before it, and a fact may appear twice (the
same record): readers keep the first of each step. The version counter restarts at max(newest checkpoint,
newest on ``policy``), so it never goes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition

from rollbus.codec import CodecError
from rollbus.events import PolicyEvent
from rollbus.kafka.bus import Event, Publisher, decode_message
from rollbus.kafka.dead_letters import DeadLetters
from rollbus.kafka.read import read_partitions
from rollbus.kafka.topics import MAX_EVENT_BYTES, describe, topic_name
from rollbus.kafka.watermark import low_watermark
from rollbus.routed_experts import RoutesStore
from rollbus.trainer import checkpoint
from rollbus.trainer.advantages import has_reward_variance
from rollbus.trainer.batch import (
    Admission,
    Group,
    GroupBuffer,
    InvalidSegment,
    fetch_routes,
    mask_of,
    segment_inputs,
    split_for_ranks,
    staleness,
    too_few_valid,
    validate,
)
from rollbus.trainer.feed import SegmentFeed, latest_policy_version, push_weights
from rollbus.trainer.learner import Learner, stop_followers
from rollbus.trainer.metrics import MetricsLog, info_count, info_rows, mismatch, step_fact
from rollbus.trainer.refill import load_refills
from rollbus.trainer.step import StepResult

log = logging.getLogger("rollbus.trainer")
Fault = Callable[[str], None]

class Trainer:
    """The consuming, committing rank; see the module docstring for the order of a step."""

    def __init__(self, learner: Learner, *, fault: Fault | None = None) -> None:
        self.learner = learner
        self.settings = learner.settings
        self.fault = fault or (lambda phase: None)
        self.segments_topic = topic_name("segments", self.settings.namespace)
        self.policy_topic = topic_name("policy", self.settings.namespace)
        self.steps_topic = topic_name("train-steps", self.settings.namespace)
        self.tasks_topic = topic_name("tasks", self.settings.namespace)
        samples = self.settings.group_size + self.settings.over_sample
        self.refills = load_refills(self.settings.refill_dataset, samples, self.settings.refill_max_depth)
        self.lost: list[tuple[str, str]] = []  # (group, why) finished untrained, refill still to decide
        self.refiller: Publisher | None = None
        self.buffer = GroupBuffer(self.settings.group_size, self.settings.over_sample)
        self.routes = RoutesStore(self.settings.routes_dir())
        self.buffer.finished.update(learner.state.finished_groups)
        self.buffer.clock_ms = max(self.buffer.finished.values(), default=0)
        self.counters: Counter[str] = Counter(learner.state.counters)
        self.position: dict[TopicPartition, int] = {}
        self.where: dict[str, tuple[TopicPartition, int]] = {}  # buffered segment id -> its place
        self.metrics = MetricsLog(self.settings.checkpoints())
        logged = self.metrics.rows()
        if learner.state.metrics and (not logged or logged[-1]["step"] < learner.state.step):
            self.metrics.write(learner.state.metrics)  # the crash came between checkpoint and log
        self._waiting_since = time.monotonic()
        self._plotting: asyncio.Task[None] | None = None  # the PNG being redrawn after the last step
        self._pruned_at: float | None = None  # monotonic time of the last walk of the routed experts store

    async def run(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        settings = self.settings
        try:
            async with Publisher(settings.bootstrap_servers, client_id="trainer") as publisher, \
                    self._refill_publisher() as refiller:  # fmt: skip
                self.publisher, self.refiller = publisher, refiller
                self.dead_letters = DeadLetters("trainer", publisher.send_bytes)
                await self._recover_version()
                await self._recover_refills()
                feed = SegmentFeed(
                    settings.bootstrap_servers, self.segments_topic, settings.consumer_group,
                    max_poll_interval_ms=int(settings.max_poll_interval * 1000),
                    session_timeout_ms=int(settings.session_timeout * 1000),
                )  # fmt: skip
                async with feed:
                    await self._consume(feed, stop)
        finally:
            stop_followers()
            if self._plotting is not None:
                await asyncio.gather(self._plotting, return_exceptions=True)
        return 0

    def _done(self) -> bool:
        return 0 < self.settings.steps <= self.learner.state.step

    async def _consume(self, feed: SegmentFeed, stop: asyncio.Event) -> None:
        while not stop.is_set() and not self._done():
            for message in await feed.fetch(timeout_ms=500):
                await self._admit(message)
                await self._refill()  # before any checkpoint that remembers a lost group as finished
                if len(self.buffer.complete) >= self.settings.rollout_batch_size:
                    await self._step(feed)
                    if self._done():
                        return

    # ---------------------------------------------------------------- admission

    async def _admit(self, message: ConsumerRecord) -> None:
        tp = TopicPartition(message.topic, message.partition)
        self.position[tp] = message.offset + 1
        event = await self.dead_letters.decoded(message, _decode)
        if event is None:
            self.counters["dead_letters"] += 1
            return
        segment: Mapping[str, Any] = event.record
        try:
            replaying = self.learner.moe_shape if self.learner.replay is not None else None
            if self.buffer.dropped(segment):  # a redelivery after its group trained: its ids may be gone
                replaying = None
            segment = fetch_routes(segment, self.routes, replaying)  # the ids, held until trained
            validate(segment, self.learner.vocab_size, self.learner.moe_shape)
            self._abandon_incomplete(int(segment["created_at"]))
            admission = self.buffer.add(segment)
        except (CodecError, InvalidSegment) as poison:
            self.counters["dead_letters"] += 1
            await self.dead_letters.letter(message, poison)
            if isinstance(poison, InvalidSegment):
                self._abandon_poisoned(segment["group_id"])
            return
        if admission is Admission.DUPLICATE:
            self.counters["duplicates_dropped"] += 1
        elif admission is Admission.LATE:
            self.counters["late_segments_dropped"] += 1
        elif admission is Admission.TWIN:
            self.counters["twin_segments_dropped"] += 1
        else:
            self.where[segment["segment_id"]] = (tp, message.offset)
            if admission is Admission.GROUP_COMPLETE:
                self._screen(self.buffer.complete[-1])

    def _abandon_poisoned(self, group_id: str) -> None:
        """The group can never complete: drop it now, not hold it (and the offsets) until the timeout."""
        if group_id in self.buffer.finished or any(g.group_id == group_id for g in self.buffer.complete):
            return  # already trained or waiting to be: the poison was an extra, not a missing piece
        group = self.buffer.abandon(group_id)
        self.counters["poisoned_groups_dropped"] += 1
        self.lost.append((group_id, "poisoned"))
        if group is not None:
            self._finish(group)

    def _abandon_incomplete(self, now_ms: int) -> None:
        """A rollout that never produces its segments must not hold its group (and the offsets) forever."""
        if not self.settings.group_timeout:
            return
        for group in self.buffer.expire(now_ms, int(self.settings.group_timeout * 1000)):
            self.counters["incomplete_groups_dropped"] += 1
            self.counters["incomplete_segments_dropped"] += len(group.segments())
            self.lost.append((group.group_id, "incomplete"))
            self._finish(group)

    def _screen(self, group: Group) -> None:
        """Drop a just-completed group left with too few valid samples, too stale, or (if so set) without
        reward variance among its valid samples."""
        segments = group.segments()
        log.info("group %s complete: %d segment(s); %d complete group(s) of %d for a step", group.group_id,
                 len(segments), len(self.buffer.complete), self.settings.rollout_batch_size)  # fmt: skip
        failed = group.infrastructure_failed()
        self.counters["infrastructure_samples"] += len(failed)
        if failed:
            log.info("group %s: %d sample(s) failed by the infrastructure, out of its mean and batch: %s",
                     group.group_id, len(failed), ", ".join(failed))  # fmt: skip
        why = too_few_valid(group, self.settings.min_valid_samples, self.settings.group_size)
        if why is not None:
            log.warning("group %s dropped: %s", group.group_id, why)
            self.counters["infrastructure_groups_dropped"] += 1
            self._finish(group, drop="infrastructure")
            return
        limit = self.settings.max_staleness
        # the version it will be trained on: a completed group is trained by the step it completes for
        oldest = max(staleness(s, self.learner.state.version) for s in segments)
        if limit is not None and oldest > limit:
            self.counters["stale_groups_dropped"] += 1
            self.counters["stale_segments_dropped"] += len(segments)
            self._finish(group, drop="stale")
        elif not has_reward_variance(group.rewards()):
            self.counters["zero_variance_groups"] += 1
            if self.settings.skip_zero_variance:
                self.counters["zero_variance_groups_skipped"] += 1
                self._finish(group, drop="zero_variance")

    def _finish(self, group: Group, *, drop: str | None = None) -> None:
        """``drop``: why a completed group will not train (it is lost, to be replaced); None: it trains."""
        if drop is not None:
            self.buffer.drop_complete(group)
            self.lost.append((group.group_id, drop))
        for segment in group.segments():
            self.where.pop(segment["segment_id"], None)

    # ---------------------------------------------------------------- refills (trainer/refill.py)

    def _refill_publisher(self) -> contextlib.AbstractAsyncContextManager[Publisher | None]:
        """A transactional publisher for refills (a refill's samples commit together), or none. Its start
        fences a killed predecessor's open transaction, so the ledger read after it is complete."""
        if self.refills is None:
            return contextlib.nullcontext()
        name = f"rollbus-trainer-refill.{self.settings.namespace or 'default'}.{self.settings.consumer_group}"
        return Publisher(self.settings.bootstrap_servers, client_id="trainer-refill", transactional_id=name)

    async def _recover_refills(self) -> None:
        """Read the ledger of refills back from ``tasks``: what was replaced is not replaced again."""
        if self.refills is None:
            return
        bootstrap = self.settings.bootstrap_servers
        count = (await describe(bootstrap, [self.tasks_topic]))[self.tasks_topic]
        partitions = [TopicPartition(self.tasks_topic, p) for p in range(count)]
        async for message in read_partitions(bootstrap, partitions, client_id="trainer-refill"):
            try:
                self.refills.note(decode_message(message, MAX_EVENT_BYTES).record)
            except CodecError:
                continue  # not ours to judge: the runner dead-letters it
        log.info("refill: %d group(s) already replaced on %s", len(self.refills.replaced), self.tasks_topic)

    async def _refill(self) -> None:
        """Replace each lost group by a new group of the dataset's next row (at most one per lost group)."""
        while self.lost:
            group_id, why = self.lost[0]
            if self.refills is not None and self.refiller is not None:
                what, tasks = self.refills.plan(group_id, int(time.time() * 1000), why)
                if tasks is not None:
                    self.fault("before_refill")
                    async with self.refiller.transaction():
                        await self.refiller.publish_many(self.tasks_topic, tasks)
                    for task in tasks:
                        self.refills.note(task)
                    log.info("group %s (%s) replaced by %s", group_id, why, tasks[0]["group_id"])
                    self.fault("after_refill")
                # a replacement already on the bus was submitted after the last checkpoint (the group is
                # lost again on replay): its count is not in the restored counters either
                self.counters["refills_too_deep" if what == "too_deep" else "refills_submitted"] += 1
            self.lost.pop(0)

    def commit_offsets(self) -> dict[TopicPartition, int]:
        """Per partition: the first offset with a buffered (untrained) segment, else all that was read."""
        buffered: dict[TopicPartition, list[int]] = {}
        for tp, offset in self.where.values():
            buffered.setdefault(tp, []).append(offset)
        return {tp: low_watermark(n, buffered.get(tp, ())) for tp, n in self.position.items()}

    # ---------------------------------------------------------------- the step

    async def _step(self, feed: SegmentFeed) -> None:
        learner, settings = self.learner, self.settings
        ready = time.monotonic()
        trained_on = learner.state.version  # staleness is measured here, as the screen measured it
        groups = self.buffer.take(settings.rollout_batch_size)
        for group in groups:
            self._finish(group)
        inputs = segment_inputs(groups, normalize_std=settings.normalize_std, version=trained_on)
        shares = split_for_ranks(inputs, learner.world_size)
        self.fault("before_train")
        result = await asyncio.to_thread(learner.step, shares)
        trained = time.monotonic()
        state = learner.state
        row = self._row(groups, result, trained_on)
        state.version += 1
        state.step += 1
        if settings.forget_finished_after:
            forgotten = self.buffer.forget(int(settings.forget_finished_after * 1000))
            self.counters["finished_groups_forgotten"] += forgotten
        state.finished_groups = dict(sorted(self.buffer.finished.items()))
        state.counters = dict(self.counters)
        infos = info_rows((s for g in groups for s in g.segments()), state.step, state.version)
        state.metrics = row
        state.metrics.update(
            step=state.step, version=state.version, wait_s=ready - self._waiting_since,
            step_s=trained - ready, infos=info_count(infos), trained_at=int(time.time() * 1000),
            **dict(self.counters),
        )  # fmt: skip
        path = await asyncio.to_thread(learner.save, settings.keep_checkpoints)
        self.fault("after_checkpoint")
        self.metrics.write_infos(infos)  # a kill right here loses the step's infos lines, not its row
        self.metrics.write(state.metrics)
        await self._publish(str(path.resolve()), state.version)
        self.fault("after_publish")
        if not await feed.commit(self.commit_offsets()):
            self.counters["commit_failures"] += 1
        self.fault("after_commit")
        self._replot()
        await self._prune_routes()
        self._waiting_since = time.monotonic()

    def _replot(self) -> None:
        """Redraw the PNG after the one being drawn (if any), off the step's path."""
        previous = self._plotting

        async def plot() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await asyncio.to_thread(self.metrics.plot)
            except Exception:  # noqa: BLE001 - a picture that could not be drawn stops no training
                log.exception("could not redraw %s", self.metrics.png)

        self._plotting = asyncio.create_task(plot())

    async def _prune_routes(self) -> None:
        """Routed experts are kept beside the log, not in it: delete those past their retention, at most
        every ``--routed-experts-prune-every`` seconds (a directory walk)."""
        retention, every = self.settings.routed_experts_retention, self.settings.routed_experts_prune_every
        if not retention or (self._pruned_at is not None and time.monotonic() - self._pruned_at < every):
            return
        self._pruned_at = time.monotonic()
        files, size = await asyncio.to_thread(self.routes.prune, retention)
        self.counters["routed_experts_pruned"] += files
        self.counters["routed_experts_pruned_bytes"] += size

    def _row(self, groups: list[Group], result: StepResult, trained_on: int) -> dict[str, Any]:
        """The step's log row; staleness against ``trained_on``, the version the batch was trained from
        (the row's ``version`` is the one the step produced: ``trained_on + 1``), so on-policy reads 0."""
        segments = [s for g in groups for segs in g.valid().values() for s in segs.values()]
        rewards = [r for g in groups for r in g.rewards().values()]
        stale = [staleness(s, trained_on) for s in segments]
        response_tokens = sum(len(s["response_ids"]) for s in segments)
        masked = sum(sum(mask_of(s)) for s in segments)
        tokens = max(result.stats.tokens, 1.0)
        return {
            "reward_mean": sum(rewards) / len(rewards),
            "solve_rate": sum(r >= self.settings.solve_threshold for r in rewards) / len(rewards),
            "groups": len(groups), "group_ids": [g.group_id for g in groups],
            "segment_ids": [s["segment_id"] for s in segments],
            "rollouts": len(rewards), "segments": len(segments),
            "infrastructure_failed": sum(len(g.infrastructure_failed()) for g in groups),
            "tokens_trained": int(result.stats.tokens), "response_tokens": response_tokens,
            "masked_fraction": masked / max(response_tokens, 1),
            "staleness_mean": sum(stale) / len(stale),
            "staleness_max": max(stale), "staleness_min": min(stale),
            "loss": result.loss, "grad_norm": result.grad_norm,
            "clip_fraction": result.stats.clipped / tokens, "approx_kl": result.stats.approx_kl / tokens,
            "version_gap_masked_fraction": result.stats.version_gap_masked / tokens,
            "icepop_masked_fraction": result.stats.icepop_masked / tokens,
            "entropy": result.stats.entropy / tokens, "is_weight_mean": result.stats.is_weight / tokens,
            **mismatch(result.stats),
        }  # fmt: skip

    # ---------------------------------------------------------------- versions

    async def _publish(self, location: str, version: int, *, announce: bool = True) -> None:
        """Step 4: the step's fact (none for version 0), then the version, then the engine's load."""
        if announce:
            row = self.learner.state.metrics
            fact = step_fact(row) if self.learner.state.step and row.get("version") == version else None
            if fact is not None:
                await self.publisher.publish(self.steps_topic, fact)
                self.fault("after_step_fact")
            record = PolicyEvent(version=version, location=location, published_at=int(time.time() * 1000))
            await self.publisher.publish(self.policy_topic, record)
        settings = self.settings
        if settings.engine_url:
            key = settings.engine_api_key.get_secret_value() if settings.engine_api_key else None
            pushed = await push_weights(
                settings.engine_url, location, version, api_key=key, timeout=settings.engine_timeout,
                retries=settings.engine_retries,
            )  # fmt: skip
            self.counters["engine_pushes" if pushed else "engine_push_failures"] += 1

    async def _recover_version(self) -> None:
        """Never go back: continue from the newest of the checkpoint and ``policy``; republish if behind."""
        state, settings = self.learner.state, self.settings
        topic = self.policy_topic
        published = await latest_policy_version(settings.bootstrap_servers, topic, MAX_EVENT_BYTES)
        if published is not None and published > state.version:
            log.warning(
                "policy topic is at version %d but the newest checkpoint is %d: continuing the count from %d "
                "with the checkpoint's weights", published, state.version, published,
            )  # fmt: skip
            state.version = published
            return
        path = checkpoint.latest(settings.checkpoints())
        if path is None:
            path = await asyncio.to_thread(self.learner.save, settings.keep_checkpoints)
        behind = published is None or published < state.version
        await self._publish(str(path.resolve()), state.version, announce=behind)


def _decode(message: ConsumerRecord) -> Event:
    return decode_message(message, MAX_EVENT_BYTES)
