"""``rollbus segmenter``: check the topics, then run the Faust worker in this process.

The worker starts here, through the project's own entry point (``faust.Worker(app)
.execute_from_commandline()``), never through Faust's ``faust`` command: its click pin is overridden by the
project, so only this path is tested.
"""

from __future__ import annotations

import argparse
import asyncio

from aiokafka.admin import NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from rollbus.codec import default_codec
from rollbus.kafka import clients
from rollbus.kafka.topics import TopicsError, describe, spec_for, topic_name, wait_visible
from rollbus.serve import one_line_errors, ready_topics
from rollbus.services.segmenter.app import TICKS, build_app, internal_topics
from rollbus.services.segmenter.settings import SegmenterSettings
from rollbus.services.segmenter.upstream_fixes import UnprovenUpstream, check_versions

add_arguments = SegmenterSettings.add_arguments


async def preflight(settings: SegmenterSettings) -> int:
    """The inputs' common partition count; TopicsError if topics are missing or counts differ anywhere,
    including the app's own changelog and tick topics (a table on other partitions joins nothing)."""
    counts = await ready_topics(settings)
    partitions = next(n for name, n in counts.items() if spec_for(name).rollout_keyed)
    existing = await describe(settings.bootstrap_servers, internal_topics(settings.namespace))
    wrong = {name: n for name, n in existing.items() if n != partitions}
    if wrong:
        listing = ", ".join(f"{name}={n}" for name, n in sorted(wrong.items()))
        raise TopicsError(
            f"the segmenter's internal topics need the inputs' {partitions} partitions, found {listing}; "
            "delete them (state is rebuilt from the raw topics) or recreate the inputs"
        )
    await create_ticks(settings, partitions)
    return partitions


async def create_ticks(settings: SegmenterSettings, partitions: int) -> None:
    """The tick topic, kept forever like the raw topics (a rebuild replays its aborts; ~50 bytes a tick)."""
    name = topic_name(TICKS, settings.namespace)
    if name in await describe(settings.bootstrap_servers, [name]):
        return
    async with clients.admin(settings.bootstrap_servers, client_id="rollbus-segmenter") as admin:
        try:
            await admin.create_topics([NewTopic(name, partitions, 1, topic_configs={"retention.ms": "-1"})])
        except TopicAlreadyExistsError:
            pass  # a second worker starting at the same moment
    await wait_visible(settings.bootstrap_servers, [name])


def run(args: argparse.Namespace) -> int:
    settings = SegmenterSettings.from_args(args)  # a bad value: rollbus.cli prints one line, exit 2
    with one_line_errors("segmenter", UnprovenUpstream, bus=settings):  # one line, exit 1
        check_versions()
        partitions = asyncio.run(preflight(settings))
    asyncio.set_event_loop(asyncio.new_event_loop())
    import faust

    app = build_app(settings, partitions)
    default_codec()  # the schemas, loaded once here (~0.1 CPU-s), not by the first event mid-work
    worker = faust.Worker(app, loglevel=settings.log_level, quiet=True)
    # Faust's terminal spinner, at --log-level warning or error, sets the root logger to DEBUG so it can
    # spin on every record: aiokafka then builds a discarded LogRecord per message sent (~7% of the CPU).
    worker.spinner = None
    worker.execute_from_commandline()  # returns only by SystemExit; Faust's worker owns the signals
    return 0
