"""``rollbus regrade --into TOPIC``: every diff in the log graded again by the current grader.

The log keeps every diff ever graded, so a fixed grader can say which past rewards were earned. This reads
``turns`` (the policy version of each rollout attempt) and ``rewards`` (what was published), then ``diffs``,
each from the beginning to the end it had when the read started; grades every diff as the grader service
does (:func:`rollbus.services.grader.core.grade_diff`, :func:`~rollbus.services.grader.core.reward_record`);
publishes the new rewards to a fresh topic (never to ``rewards``: the segmenter and trainer go on as they
were); and reports per policy version how many rewards changed and with which flags (``changes.py``).

Bad input never stops it and is never dropped silently: an undecodable diff, a diff without a rollout id, or
one that crashes the grader is a ``problem`` line naming its partition and offset, and the log keeps it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

from aiokafka import ConsumerRecord
from aiokafka.errors import KafkaError
from pydantic import Field

from rollbus.codec import CodecError, Decoded, encode
from rollbus.events import DiffEvent, RewardEvent, TurnEvent
from rollbus.kafka.bus import EventTooLarge, Publisher
from rollbus.kafka.reach import BrokerUnreachable, quiet_kafka_logs
from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import TopicsError, check_topics, create_fresh, spec_for, topic_name
from rollbus.services.grader.changes import Ledger, report_lines
from rollbus.services.grader.core import grade_diff, reward_record, without_bulk
from rollbus.services.grader.settings import DiffGrading
from rollbus.settings import BusSettings


class RegradeSettings(DiffGrading, BusSettings):
    """Settings of ``rollbus regrade`` (variables ROLLBUS_REGRADE_X_Y): how a diff is graded, as the grader
    service's, plus where the new rewards go."""

    model_config = BusSettings.scoped("regrade")
    into: str = Field(..., min_length=1, description="fresh topic to write the regraded rewards to")
    concurrency: int = Field(1, ge=1, description="diffs graded at once (each in sandboxes of its own)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    RegradeSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = RegradeSettings.from_args(args)
    quiet_kafka_logs()
    try:
        report = asyncio.run(regrade(settings))
    except (TopicsError, BrokerUnreachable, KafkaError) as error:
        print(f"rollbus regrade: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report, sort_keys=True) if args.json else "\n".join(report_lines(report)))
    return 0


async def regrade(settings: RegradeSettings) -> dict[str, Any]:
    """Regrade every diff into ``settings.into``; returns the report (``changes.Ledger.report``)."""
    counts = await check_topics(settings.bootstrap_servers, settings.namespace)
    await create_fresh(settings.bootstrap_servers, settings.into, counts["rewards"], like="rewards")
    ledger = Ledger()
    async for where, decoded in events(settings, "turns"):
        if isinstance(decoded, Decoded) and decoded.event_type == "turn":
            ledger.turn(decoded.event_as(TurnEvent))
        else:
            ledger.problem(where, "not a turn, so its attempt may count under an older or unknown version")
    async for where, decoded in events(settings, "rewards"):
        if isinstance(decoded, Decoded) and decoded.event_type == "reward":
            ledger.reward_published(decoded.event_as(RewardEvent))
        else:
            ledger.problem(where, "not a reward, so its attempt may count as never graded")
    max_bytes = spec_for("rewards").max_message_bytes
    async with Publisher(
        settings.bootstrap_servers, client_id="rollbus-regrade", max_event_bytes=max_bytes
    ) as out:
        batch: list[tuple[str, DiffEvent]] = []
        async for where, decoded in events(settings, "diffs"):
            ledger.diffs += 1
            diff = usable_diff(ledger, where, decoded)
            if diff is not None and ledger.first_time(diff):
                batch.append((where, diff))
            if len(batch) >= settings.concurrency:
                await grade_batch(settings, ledger, out, batch)
                batch = []
        await grade_batch(settings, ledger, out, batch)
    return {"into": settings.into, **ledger.report()}


async def events(settings: RegradeSettings, base: str) -> AsyncIterator[tuple[str, Decoded | CodecError]]:
    """``base``'s messages from the beginning to its current end, each with where it is (``diffs[2]@17``)."""
    plan = ReadPlan(topic_name(base, settings.namespace))
    message: ConsumerRecord
    async for message, decoded in read(settings.bootstrap_servers, plan):
        yield f"{base}[{message.partition}]@{message.offset}", decoded


def usable_diff(ledger: Ledger, where: str, decoded: Decoded | CodecError) -> DiffEvent | None:
    """The diff, or None with the reason in the ledger's problems."""
    if isinstance(decoded, CodecError):
        ledger.problem(where, f"undecodable diff, not regraded ({decoded})")
        return None
    if decoded.event_type != "diff":
        ledger.problem(where, f"a {decoded.event_type} event on diffs, not regraded")
        return None
    diff = decoded.event_as(DiffEvent)
    if not diff.rollout_id:
        ledger.problem(where, "diff without a rollout_id, not regraded: no reward can be keyed to it")
        return None
    return diff


async def grade_batch(
    settings: RegradeSettings, ledger: Ledger, out: Publisher, batch: list[tuple[str, DiffEvent]]
) -> None:
    """Grade ``batch`` at once, then publish and tally in log order (a crash is a problem, not a stop)."""
    config = settings.grade_config()
    grades = await asyncio.gather(
        *(
            grade_diff(diff, settings.data_dir, config, grade_failed_rollouts=settings.grade_failed_rollouts)
            for _, diff in batch
        ),
        return_exceptions=True,
    )
    for (where, diff), result in zip(batch, grades, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            ledger.problem(where, f"the grader crashed, not regraded: {type(result).__name__}: {result}")
            continue
        record = reward_record(diff, result)
        try:
            await out.publish_bytes(settings.into, encode("reward", record), key=diff.rollout_id)
        except EventTooLarge:
            smaller = encode("reward", without_bulk(record))
            await out.publish_bytes(settings.into, smaller, key=diff.rollout_id)
        ledger.regraded(record)
