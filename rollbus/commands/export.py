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
from typing import Any, Literal

from pydantic import Field

from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import topic_name
from rollbus.settings import BusSettings


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


async def _records(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    found = []
    async for _, decoded in read(bootstrap, ReadPlan(topic, "beginning")):
        if not isinstance(decoded, Exception):  # poison is the dead-letter tooling's business
            found.append(decoded.record)
    return found


async def export_completions(settings: ExportSettings) -> tuple[int, int]:
    ns = settings.namespace
    tasks = {
        t["rollout_id"]: t
        for t in reversed(await _records(settings.bootstrap_servers, topic_name("tasks", ns)))
    }
    rewards = {
        r["rollout_id"]: r for r in await _records(settings.bootstrap_servers, topic_name("rewards", ns))
    }
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


def completion_record(reward: dict[str, Any], task: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ms-swift-style line for a gym reward (and its task, when still on ``tasks``); None if not gym."""
    try:
        details = json.loads(reward["details"])
    except json.JSONDecodeError:
        return None
    if not isinstance(details, dict) or details.get("kind") != "gym":
        return None
    return {
        "messages": details.get("messages") or [],
        "reward": reward["reward"],
        "step_rewards": list(reward["step_rewards"]),
        "trajectory_infos": json.loads(reward["infos"] or "[]"),
        "env_config": _json(task, "env_config"),
        "ctx_config": _json(task, "ctx_config"),
        "rollout_id": reward["rollout_id"],
        "group_id": reward["group_id"],
        "attempt_id": reward["attempt_id"],
        "failure_kind": reward["failure_kind"],
    }


def _json(task: dict[str, Any] | None, name: str) -> Any:
    raw = (task or {}).get(name)
    try:
        return json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return raw
