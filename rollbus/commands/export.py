"""``rollbus export completions --out FILE.jsonl``: gym episodes as ms-swift-style records, from the topics.

One line per gym rollout that has a reward (the newest reward wins when a task ran more than once)::

    {"messages": [...], "reward": 0.5, "step_rewards": [0.0, 0.5], "trajectory_infos": [{...}, ...],
     "env_config": {...}, "ctx_config": {...} | null, "rollout_id": ..., "group_id": ..., "attempt_id": ...,
     "failure_kind": null}

``messages`` is the episode's conversation as the gym runner kept it (reward ``details.messages``); the
token-exact record of the same turns is on ``turns``. Coding-agent rewards have no conversation and are
skipped (counted on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import Field

from rollbus.events import EventRecord, RewardEvent, TaskEvent
from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import topic_name
from rollbus.settings import BusSettings

E = TypeVar("E", bound=EventRecord)


class ExportSettings(BusSettings):
    """Settings of ``rollbus export``."""

    model_config = BusSettings.scoped("export")
    out: Path = Field(Path("completions.jsonl"), description="file to write (JSON lines)")
    failed: Literal["include", "skip"] = Field("include", description="episodes with a failure_kind")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("what", choices=["completions"], help="what to export")
    ExportSettings.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = ExportSettings.from_args(args)
    written, skipped = asyncio.run(export_completions(settings))
    print(f"wrote {written} records to {settings.out} ({skipped} non-gym rewards skipped)", file=sys.stderr)
    return 0


async def _events(bootstrap: str, topic: str, cls: type[E]) -> list[E]:
    found = []
    async for _, decoded in read(bootstrap, ReadPlan(topic, "beginning")):
        # poison (or another event type) is the dead-letter tooling's business
        if not isinstance(decoded, Exception) and decoded.event_type == cls.event_type:
            found.append(decoded.event_as(cls))
    return found


async def export_completions(settings: ExportSettings) -> tuple[int, int]:
    ns = settings.namespace
    bootstrap = settings.bootstrap_servers
    tasks = {t.rollout_id: t for t in reversed(await _events(bootstrap, topic_name("tasks", ns), TaskEvent))}
    rewards = {r.rollout_id: r for r in await _events(bootstrap, topic_name("rewards", ns), RewardEvent)}
    lines, skipped = [], 0
    for rollout, reward in rewards.items():
        record = completion_record(reward, tasks.get(rollout))
        if record is None:
            skipped += 1
        elif settings.failed == "include" or record["failure_kind"] is None:
            lines.append(json.dumps(record, ensure_ascii=False))
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    settings.out.write_text("".join(line + "\n" for line in lines))
    return len(lines), skipped


def completion_record(reward: RewardEvent, task: TaskEvent | None) -> dict[str, Any] | None:
    """The ms-swift-style line for a gym reward (and its task, when still on ``tasks``); None if not gym."""
    try:
        details = json.loads(reward.details)
    except json.JSONDecodeError:
        return None
    if not isinstance(details, dict) or details.get("kind") != "gym":
        return None
    return {
        "messages": details.get("messages") or [],
        "reward": reward.reward,
        "step_rewards": list(reward.step_rewards),
        "trajectory_infos": json.loads(reward.infos or "[]"),
        "env_config": _json(task.env_config if task else None),
        "ctx_config": _json(task.ctx_config if task else None),
        "rollout_id": reward.rollout_id,
        "group_id": reward.group_id,
        "attempt_id": reward.attempt_id,
        "failure_kind": reward.failure_kind,
    }


def _json(raw: str | None) -> Any:
    try:
        return json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return raw
