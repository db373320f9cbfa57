"""``rollbus submit DATASET``: one `tasks` event per sample of every good row, a group per row.

``DATASET`` is a JSONL file of rollbus rows, SWE-bench / SWE-Gym rows or SWE-bench Pro rows (detected per
row, or ``--format``), a Harbor task folder, or a folder of them (:mod:`rollbus.task_formats`). Bad rows are
reported on stderr as ``DATASET:LINE: why`` (a Harbor task: its folder) and skipped; every good row is still
submitted. Exit status: 0 all rows submitted, 1 some rows skipped, 2 nothing readable.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Literal

from aiokafka.errors import KafkaError
from pydantic import Field

from rollbus.kafka.bus import Publisher
from rollbus.kafka.topics import topic_name
from rollbus.rows import Row, RowError, RowKeys, read_dataset, tasks_for
from rollbus.settings import BusSettings
from rollbus.task_formats.common import FormatError

TaskFormat = Literal["rollbus", "swebench", "swepro", "harbor"]


class SubmitSettings(BusSettings):
    """Settings of ``rollbus submit`` (flags --x-y, variables ROLLBUS_SUBMIT_X_Y)."""

    model_config = BusSettings.scoped("submit")
    n_samples_per_prompt: int = Field(1, ge=1, le=4096, description="samples (rollouts) per row, one group")
    input_key: str = Field("prompt", min_length=1, description="row key of the prompt")
    label_key: str = Field("label", min_length=1, description="row key of the label")
    metadata_key: str = Field("metadata", min_length=1, description="row key of the metadata object")
    format: TaskFormat | None = Field(None, description="the dataset's format (default: detected per row)")
    dataset_revision: str | None = Field(
        None, description="the dataset's revision (commit or version), kept on every task's metadata.source"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dataset", type=Path, help="JSONL (rollbus, SWE-bench or SWE-bench Pro rows) or Harbor task folder(s)"
    )
    SubmitSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = SubmitSettings.from_args(args)
    keys = RowKeys(settings.input_key, settings.label_key, settings.metadata_key)
    try:
        rows, bad = split_rows(args.dataset, keys, settings.format, settings.dataset_revision)
    except OSError as exc:
        print(f"rollbus submit: cannot read {args.dataset}: {exc.strerror}", file=sys.stderr)
        return 2
    except FormatError as exc:
        print(f"rollbus submit: {exc}", file=sys.stderr)
        return 2
    for where, error in bad:
        print(f"{where}: {error}; skipped", file=sys.stderr)
    tasks = [task for row in rows for task in tasks_for(row, settings.n_samples_per_prompt)]
    if tasks:
        try:
            asyncio.run(publish(settings, tasks))
        except KafkaError as exc:
            print(f"rollbus submit: nothing submitted: {exc}", file=sys.stderr)
            return 2
    print(f"submitted {len(tasks)} tasks ({len(rows)} rows x {settings.n_samples_per_prompt} samples) "
          f"to {topic_name('tasks', settings.namespace)}; {len(bad)} bad rows skipped")  # fmt: skip
    return 0 if not bad else (1 if rows else 2)


def split_rows(
    path: Path, keys: RowKeys, fmt: str | None = None, revision: str | None = None
) -> tuple[list[Row], list[tuple[str, RowError]]]:
    rows: list[Row] = []
    bad: list[tuple[str, RowError]] = []
    for item in read_dataset(path, keys, fmt, revision):
        if isinstance(item, Row):
            rows.append(item)
        else:
            bad.append(item)
    return rows, bad


async def publish(settings: BusSettings, tasks: list[dict]) -> None:
    async with Publisher(settings.bootstrap_servers, client_id="rollbus-submit") as publisher:
        await publisher.publish_many(topic_name("tasks", settings.namespace), tasks)
