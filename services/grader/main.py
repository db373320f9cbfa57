"""Grader: consumes `diffs`, grades each patch in fresh network-less sandboxes, publishes `rewards`.

One member of the ``--consumer-group`` grades one diff at a time (add graders to scale: partitions are
shared among them). A diff is committed only after its reward is on the bus (at-least-once: a grader killed
mid-grade leaves the diff to the next member, which publishes the same grade again; rewards carry rollout and
attempt ids, so readers keep one). Only a rollout's first diff is rewarded (:mod:`.first_diffs`): a later
one, from a runner that ran a task already answered, is committed with no reward. Undecodable diffs, diffs
without a rollout id go to ``dead-letters`` with the error, and consumption goes on; everything a patch or a
row can do wrong is a reward of 0 with a failure kind, and an exception inside the grade itself is the
verdict ``grader_error`` (reward 0, its cause in the note), never a dead letter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

from rollbus.events import DiffEvent
from rollbus.kafka.bus import Event, EventConsumer, EventTooLarge, PermanentError, Publisher
from rollbus.kafka.topics import topic_name
from rollbus.sandbox import bwrap_usable
from rollbus.sandbox.scratch import GRADE_SCRATCH_PREFIX, sweep_scratch
from rollbus.serve import run_service
from rollbus.services.grader.core import grade_diff, reward_record, without_bulk
from rollbus.services.grader.first_diffs import FirstDiffs
from rollbus.services.grader.settings import GraderSettings

log = logging.getLogger("rollbus.grader")
add_arguments = GraderSettings.add_arguments
POLL_MARGIN_S = 120.0  # beyond one batch's grading, before the group would evict this member


def run(args: argparse.Namespace) -> int:
    settings = GraderSettings.from_args(args)  # a bad flag or variable: one line, exit 2 (rollbus.cli)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if settings.backend == "local" and not bwrap_usable():  # the docker backend's sandboxes are containers
        raise SystemExit(
            "rollbus grader: bubblewrap cannot create sandboxes here "
            "(apt-get install bubblewrap; or --backend docker)"
        )
    # no topics, or no broker: one line, not a traceback; SIGTERM/SIGINT stop the consumer
    return run_service("grader", lambda stop: serve(settings, stop), bus=settings)


class DiffGrader:
    """The consumer's handler: one diff in, one reward out."""

    def __init__(self, settings: GraderSettings, publisher: Publisher) -> None:
        self.settings = settings
        self.publisher = publisher
        self.rewards = topic_name("rewards", settings.namespace)
        self.config = settings.grade_config()
        diffs = topic_name("diffs", settings.namespace)
        self.first_diffs = FirstDiffs(settings.bootstrap_servers, diffs, client_id="rollbus-grader")

    async def __call__(self, event: Event) -> None:
        diff = event.event_as(DiffEvent)
        if not diff.rollout_id:
            raise PermanentError("diff without a rollout_id: no reward can be keyed to it")
        if not await self.first_diffs.is_first(event.partition, event.offset, event.key):
            log.warning("rollout %s attempt %s: not the rollout's first diff: no reward",
                        diff.rollout_id, diff.attempt_id or "-")  # fmt: skip
            return
        try:
            result = await grade_diff(
                diff,
                self.settings.data_dir,
                self.config,
                grade_failed_rollouts=self.settings.grade_failed_rollouts,
            )
        except Exception as exc:  # a grader bug: keep the diff for replay rather than stop the group
            log.exception("grading rollout %s crashed", diff.rollout_id)
            raise PermanentError(f"grader crashed: {type(exc).__name__}: {exc}") from exc
        record = reward_record(diff, result)
        try:
            await self.publisher.publish(self.rewards, record)
        except EventTooLarge:
            await self.publisher.publish(self.rewards, without_bulk(record))
        log.info(
            "rollout %s attempt %s: reward %.1f failure %s flags %s",
            diff.rollout_id, diff.attempt_id or "-", result.reward, result.failure_kind,
            ",".join(result.flags) or "-",
        )  # fmt: skip


async def serve(settings: GraderSettings, stop: asyncio.Event) -> None:
    """Consume ``diffs`` until ``stop`` is set (the topics are checked already: :func:`run`)."""
    for path in sweep_scratch(GRADE_SCRATCH_PREFIX, settings.grade_config().scratch_dir):
        log.info("removed the grading scratch of a dead grader: %s", path)  # its capped tmpfs, killed -9
    if settings.backend == "docker":  # a grader killed -9 left its sandboxes' containers sleeping forever
        from rollbus.sandbox import docker_backend, docker_engine

        client = await asyncio.to_thread(docker_engine.client)
        if swept := await asyncio.to_thread(docker_backend.sweep_stale, client):
            log.info("swept %d docker sandboxes of dead graders and runners", len(swept))
    poll_interval_ms = int((settings.grade_timeout * settings.max_batch + POLL_MARGIN_S) * 1000)
    async with Publisher(settings.bootstrap_servers, client_id="rollbus-grader") as publisher:
        handler = DiffGrader(settings, publisher)
        consumer = EventConsumer(
            settings.bootstrap_servers, [topic_name("diffs", settings.namespace)],
            consumer_group=settings.consumer_group,
            handler=handler, service="grader", publisher=publisher, max_batch=settings.max_batch,
            max_poll_interval_ms=poll_interval_ms, fetch_max_wait_ms=settings.fetch_wait_ms,
        )  # fmt: skip
        async with consumer:
            sandboxes = "bwrap sandboxes" if settings.backend == "local" else f"{settings.backend} sandboxes"
            log.info("grading diffs as group %s (%s, no network)", settings.consumer_group, sandboxes)
            with contextlib.suppress(asyncio.CancelledError):
                await consumer.run(stop)
