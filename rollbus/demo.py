"""``rollbus demo``: the furthest slice that works end to end, on embedded defaults.

A real Apache Kafka broker, the CPU engine replaying a scripted policy, the adapter, and the real Claude Code
CLI in a bubblewrap sandbox fixing the bug in ``examples/buggy_repo``. The demo then plays the runner and the
grader inline (those services are not built yet): it publishes the agent's diff, grades it in a second, clean
sandbox, publishes the reward, and replays the rollout's turns from the bus into reward/K segments with their
loss-mask summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from rollbus import claude_cli
from rollbus.broker import EmbeddedBroker, free_port
from rollbus.bus import Publisher
from rollbus.config import add_option
from rollbus.replay import ReadPlan, read
from rollbus.sandbox import BwrapSandbox, Completed, apply_patch, git_diff, prepare_repo
from rollbus.services import ServiceProcess
from rollbus.topics import create_topics
from rollbus.trajectory import Segment, fan_out
from rollbus.turn_log import frozen_chains, resolve_turns

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODEL = "rollbus-engine"
TEST_CMD = ["python3", "-m", "unittest", "-q"]
TEST_ENV = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}  # no __pycache__ in the agent's diff
console = Console(highlight=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_option(
        parser, "--state-dir", default=".rollbus", type=Path, help="local state directory", shared=True
    )
    add_option(
        parser,
        "--bootstrap-servers",
        default="",
        help="use this Kafka cluster instead of starting the embedded broker",
        shared=True,
    )
    add_option(parser, "--repo", default=EXAMPLES / "buggy_repo", type=Path, help="repository to fix")
    add_option(
        parser, "--script", default=EXAMPLES / "scripts" / "fix_calc.json", type=Path, help="scripted policy"
    )
    add_option(
        parser, "--prompt", default="The tests in /workspace fail. Fix the bug.", help="task for the agent"
    )
    add_option(parser, "--max-turns", default=8, type=int, help="agent turns allowed")


@dataclass
class Episode:
    rollout_id: str
    agent: Completed
    patch: str
    solved: bool
    grade: Completed


def run(args: argparse.Namespace) -> int:
    state = Path(args.state_dir).resolve() / "demo"
    state.mkdir(parents=True, exist_ok=True)
    broker = None
    bootstrap = args.bootstrap_servers
    if not bootstrap:
        broker = EmbeddedBroker(state, port=free_port())
        seconds = broker.start()
        bootstrap = broker.bootstrap_servers
        console.print(f"[bold]broker[/bold]  Apache Kafka (KRaft) on {bootstrap}, ready in {seconds:.1f}s")
    try:
        return asyncio.run(demo(args, bootstrap, state))
    finally:
        if broker is not None:
            broker.stop()


async def demo(args: argparse.Namespace, bootstrap: str, state: Path) -> int:
    await create_topics(bootstrap)
    engine_port, adapter_port, admin = free_port(), free_port(), uuid.uuid4().hex
    engine_key = uuid.uuid4().hex  # the engine's control key: the adapter gets it, the agent sandbox never
    engine = ServiceProcess(
        "engine",
        ["--port", str(engine_port), "--policy", "scripted", "--script", str(args.script),
         "--api-key", engine_key],
        health_url=f"http://127.0.0.1:{engine_port}/health",
        log_dir=state / "logs",
    )
    adapter = ServiceProcess(
        "adapter",
        ["--port", str(adapter_port), "--sglang-url", f"http://127.0.0.1:{engine_port}",
         "--bootstrap-servers", bootstrap, "--admin-token", admin, "--state-dir", str(state),
         "--engine-api-key", engine_key],
        health_url=f"http://127.0.0.1:{adapter_port}/healthz",
        log_dir=state / "logs",
    )  # fmt: skip
    with engine, adapter:
        console.print(f"[bold]engine[/bold]  scripted policy {args.script.name} on :{engine_port}")
        console.print(f"[bold]adapter[/bold] Anthropic Messages API on :{adapter_port}")
        episode = await run_episode(args, f"http://127.0.0.1:{adapter_port}", admin)
        async with Publisher(bootstrap, client_id="rollbus-demo") as publisher:
            await publish_outcome(publisher, episode)
    records = await replay_turns(bootstrap, episode.rollout_id)
    segments = segments_of(records, episode.rollout_id, 1.0 if episode.solved else 0.0)
    print_summary(episode, records, segments, bootstrap, None if args.bootstrap_servers else state)
    return 0 if episode.solved and segments else 1


async def run_episode(args: argparse.Namespace, adapter_url: str, admin: str) -> Episode:
    """The runner's job, inline: a fresh sandbox, the real CLI against the adapter, the agent's diff."""
    rollout_id = f"demo-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(base_url=adapter_url, headers={"authorization": f"Bearer {admin}"}) as http:
        token = (await http.post("/admin/sessions", json={"rollout_id": rollout_id})).raise_for_status()
        session_token = token.json()["token"]
        with tempfile.TemporaryDirectory(prefix="rollbus-demo-") as scratch:
            workdir = prepare_repo(args.repo, Path(scratch) / "repo")
            cli = claude_cli.fetch()
            sandbox = BwrapSandbox(workdir, network="loopback", ro_binds={cli: claude_cli.SANDBOX_BINARY})
            try:
                before = await sandbox.run(TEST_CMD, TEST_ENV, timeout=120)
                console.print(f"[bold]task[/bold]    {args.prompt}  (tests before: exit {before.exit_code})")
                cmd = claude_cli.build_command(
                    args.prompt, model=MODEL, max_turns=args.max_turns, binary=claude_cli.SANDBOX_BINARY
                )
                env = claude_cli.build_env(
                    adapter_url, session_token, model=MODEL, home=sandbox.home,
                    extra={"PYTHONDONTWRITEBYTECODE": "1"},
                )  # fmt: skip
                agent = await sandbox.run(cmd, env, timeout=600)
            finally:
                await sandbox.close()
            patch = git_diff(workdir)
        await http.post(f"/admin/sessions/{rollout_id}/close")
    console.print(f"[bold]agent[/bold]   Claude Code exited {agent.exit_code} in {agent.wall_time_s:.1f}s")
    solved, grade = await grade_patch(args.repo, patch)
    return Episode(rollout_id, agent, patch, solved, grade)


async def grade_patch(repo: Path, patch: str) -> tuple[bool, Completed]:
    """The grader's job, inline: the patch on a clean copy, the tests in a second, network-less sandbox."""
    with tempfile.TemporaryDirectory(prefix="rollbus-grade-") as scratch:
        clean = prepare_repo(repo, Path(scratch) / "repo")
        if patch and not apply_patch(clean, patch):
            return False, Completed(1, "", "patch did not apply", 0.0, False)
        sandbox = BwrapSandbox(clean, network="none")
        try:
            graded = await sandbox.run(TEST_CMD, TEST_ENV, timeout=300)
        finally:
            await sandbox.close()
    return graded.exit_code == 0 and not graded.timed_out, graded


async def publish_outcome(publisher: Publisher, episode: Episode) -> None:
    now = int(time.time() * 1000)
    await publisher.publish("diffs", {
        "rollout_id": episode.rollout_id, "patch": episode.patch, "exit_status": episode.agent.exit_code,
        "wall_time_s": episode.agent.wall_time_s, "turns": agent_turns(episode.agent), "error": None,
        "at": now,
    })  # fmt: skip
    await publisher.publish("rewards", {
        "rollout_id": episode.rollout_id, "reward": 1.0 if episode.solved else 0.0, "solved": episode.solved,
        "applied_cleanly": episode.grade.stderr != "patch did not apply",
        "details": json.dumps({"tests_exit": episode.grade.exit_code}), "failure_kind": None, "at": now,
    })  # fmt: skip


def agent_turns(agent: Completed) -> int:
    """``num_turns`` from the CLI's final stream-json result event (0 if it printed none)."""
    for line in reversed(agent.stdout.strip().splitlines()):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if event.get("type") == "result":
            return int(event.get("num_turns", 0))
    return 0


async def replay_turns(bootstrap: str, rollout_id: str) -> list[dict[str, Any]]:
    """The rollout's ``turn`` events, read back from the bus in order."""
    plan = ReadPlan("turns", "beginning", key=rollout_id.encode())
    events = read(bootstrap, plan)
    return [decoded.record async for _, decoded in events if not isinstance(decoded, Exception)]


def segments_of(records: list[dict[str, Any]], rollout_id: str, reward: float) -> list[Segment]:
    """What the segmenter will do: turns -> frozen chains -> reward/K segments."""
    kinds = {r["chain_id"]: r["chain_kind"] for r in records}
    return fan_out(frozen_chains(resolve_turns(records), kinds), rollout_id, reward)


def print_summary(
    episode: Episode,
    records: list[dict[str, Any]],
    segments: list[Segment],
    bootstrap: str,
    embedded_state: Path | None,
) -> None:
    turns = Table(title=f"turns of rollout {episode.rollout_id}, replayed from the bus")
    columns = ("chain", "kind", "turn", "prompt tokens", "sent (new suffix)", "sampled", "finish", "policy")
    for column in columns:
        turns.add_column(column)
    for r in records:
        turns.add_row(
            r["chain_id"], r["chain_kind"], str(r["turn_index"]), str(r["prompt_tokens"]),
            str(len(r["prompt_ids"])), str(len(r["output_ids"])), r["finish_reason"],
            str(r["policy_version"]),
        )  # fmt: skip
    console.print(turns)
    sampled = sum(len(r["output_ids"]) for r in records if r["chain_kind"] != "side")
    trained = sum(sum(s.loss_mask) for s in segments)
    console.print(f"[bold]loss mask[/bold] {trained} of {sampled} sampled tokens trained (mask 1), "
                  f"{sampled - trained} masked")  # fmt: skip
    console.print("[bold]diff[/bold]")
    console.print(episode.patch.rstrip() or "(empty)", markup=False)
    verdict = "[green]solved[/green]" if episode.solved else "[red]not solved[/red]"
    console.print(f"[bold]grade[/bold]   clean sandbox, tests exit {episode.grade.exit_code}: {verdict}")
    table = Table(title=f"segments of rollout {episode.rollout_id}")
    for column in ("index/K", "kind", "chain", "prompt", "response", "trained (mask 1)", "reward share"):
        table.add_column(column)
    for s in segments:
        table.add_row(
            f"{s.index}/{s.num_segments}", s.kind, s.chain_id or "", str(len(s.prompt_ids)),
            str(len(s.response_ids)), str(sum(s.loss_mask)), f"{s.reward:.3f}",
        )  # fmt: skip
    console.print(table)
    console.file.flush()
    print(replay_hint(episode.rollout_id, bootstrap, embedded_state), flush=True)  # whole lines, to copy


def replay_hint(rollout_id: str, bootstrap: str, embedded_state: Path | None) -> str:
    """The commands that replay this rollout after the demo, true for the broker it used: its own
    embedded one (stopped by now: start it again from its state dir, which records its port) or the
    cluster given with --bootstrap-servers."""
    replay = f"rollbus replay turns --key {shlex.quote(rollout_id)} --format table"
    if embedded_state is None:
        return f"replay it yourself: {replay} --bootstrap-servers {shlex.quote(bootstrap)}"
    state = shlex.quote(str(embedded_state))
    return (
        f"replay it yourself (the demo's broker stopped with it):\n"
        f"  rollbus broker start --state-dir {state}\n"
        f"  {replay} --state-dir {state}\n"
        f"  rollbus broker stop --state-dir {state}"
    )
