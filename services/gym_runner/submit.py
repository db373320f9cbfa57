"""``rollbus gym-submit DATASET.jsonl``: ms-swift gym rows, unchanged, as `tasks` (n samples a row, a group).

A row is ``{"messages": [...], "env_config": {"name": ..., ...}, "ctx_config": {...}, ...}``, every key
optional: a row without ``env_config`` is published with ``env_config = {}`` (what makes a task a gym task),
so the runner's ``--gym-env`` picks its env, as ms-swift's ``--gym_env`` does. Other keys go to the task's
``metadata``, from which the runner rebuilds ``request.data_dict`` as ms-swift does. Bad rows are reported on
stderr as ``DATASET:LINE: why`` and skipped. Exit status: 0 all submitted, 1 some skipped, 2 none readable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError
from pydantic import Field

from rollbus.kafka.bus import Publisher
from rollbus.kafka.topics import topic_name
from rollbus.services.gym_runner.gym import GymConfigError, parse_config
from rollbus.settings import BusSettings


class GymSubmitSettings(BusSettings):
    """Settings of ``rollbus gym-submit``."""

    model_config = BusSettings.scoped("gym-submit")
    n_samples_per_prompt: int = Field(1, ge=1, le=4096, description="samples (rollouts) per row, one group")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", type=Path, help="JSONL file of ms-swift gym rows")
    GymSubmitSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = GymSubmitSettings.from_args(args)
    try:
        lines = args.dataset.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        print(f"rollbus gym-submit: cannot read {args.dataset}: {exc.strerror}", file=sys.stderr)
        return 2
    tasks, bad = [], 0
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            tasks += tasks_for(
                parse_row(text), settings.n_samples_per_prompt, f"{args.dataset.stem}-{number}"
            )
        except GymConfigError as exc:
            bad += 1
            print(f"{args.dataset}:{number}: {exc}; skipped", file=sys.stderr)
    if tasks:
        try:
            asyncio.run(publish(settings, tasks))
        except KafkaError as exc:
            print(f"rollbus gym-submit: nothing submitted: {exc}", file=sys.stderr)
            return 2
    where = topic_name("tasks", settings.namespace)
    print(f"submitted {len(tasks)} gym tasks to {where}; {bad} bad rows skipped")
    return 0 if not bad else (1 if tasks else 2)


def parse_row(text: str) -> dict[str, Any]:
    """A row checked for shape (the env name is the runner's to resolve, with its plugins)."""
    try:
        row = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise GymConfigError(f"not a JSON object: {exc}") from None
    if not isinstance(row, dict):
        raise GymConfigError(f"a row is a JSON object, not {type(row).__name__}")
    parse_config(row.get("env_config"), "env_config")
    parse_config(row.get("ctx_config"), "ctx_config")
    messages = row.get("messages", [])
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise GymConfigError("messages must be a list of {role, content} objects")
    return row


def tasks_for(
    row: dict[str, Any], samples: int, name: str, now_ms: int | None = None
) -> list[dict[str, Any]]:
    group = f"{name}-{uuid.uuid4().hex[:10]}"
    rest = {k: v for k, v in row.items() if k not in ("messages", "env_config", "ctx_config")}
    prompt = next((m.get("content") for m in row.get("messages", []) if m.get("role") == "user"), "")
    common = {
        "group_id": group, "group_size": samples, "prompt": prompt if isinstance(prompt, str) else "",
        "label": None, "metadata": json.dumps(rest), "submitted_at": now_ms or int(time.time() * 1000),
        "env_config": json.dumps(row.get("env_config") or {}),
        "ctx_config": json.dumps(row["ctx_config"]) if row.get("ctx_config") else None,
        "messages": json.dumps(row.get("messages", [])),
    }  # fmt: skip
    return [{"rollout_id": f"{group}-{i}", "sample_index": i, **common} for i in range(samples)]


async def publish(settings: GymSubmitSettings, tasks: list[dict[str, Any]]) -> None:
    async with Publisher(settings.bootstrap_servers, client_id="rollbus-gym-submit") as publisher:
        await publisher.publish_many(topic_name("tasks", settings.namespace), tasks)
