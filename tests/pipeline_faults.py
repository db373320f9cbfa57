"""The whole pipeline under SIGKILL: ``rollbus up`` on a real broker, rollouts of the bundled dataset
submitted, and while they run every part killed once (``-9``), one after another at seeded random moments,
each brought back by the supervisor. Then the bus is judged: what the pipeline promises after any crash.

Used by ``tests/integration/test_pipeline_faults.py`` (one round, sized for CI) and by hand as a soak::

    python -m tests.pipeline_faults --rounds 5 --tasks 10 --seed 7

which prints what it killed, when, and what it checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rollbus.codec import CodecError
from rollbus.events import judge as same_fact
from rollbus.events import spec
from rollbus.grading.rows import absolute_paths
from rollbus.kafka.broker import answers_metadata
from rollbus.kafka.replay import ReadPlan, read
from rollbus.kafka.topics import topic_name
from rollbus.polling import wait_until_async
from rollbus.services.stack.supervisor import Supervisor
from rollbus.services.stack.up import EXAMPLES, Stack, StackSettings, running_stack

TARGETS = ("adapter", "sandbox-runner", "grader", "segmenter", "trainer", "engine", "broker")
DATASET = EXAMPLES / "swe-mini" / "tasks.jsonl"
NAMESPACE = "faults"
DEMO_TASKS = {json.loads(line)["metadata"]["instance_id"] for line in (DATASET.parent / "demo.jsonl").open()}


@dataclass
class Kill:
    target: str
    pid: int
    at: float  # seconds since the run began
    rewards_then: int  # rollouts rewarded when it came


@dataclass
class Verdict:
    """What the bus says after the run; ``problems`` empty means every promise held."""

    rollouts: int = 0
    rewards: int = 0
    failures: dict[str, int] = field(default_factory=dict)
    segments: int = 0
    rebuilt: int = 0
    steps: int = 0
    groups_trained: int = 0
    problems: list[str] = field(default_factory=list)


async def topic(stack: Stack, base: str) -> list[tuple[bytes, dict[str, Any]]]:
    """Every event of ``base`` in the stack's namespace, to its current end: (raw value, record)."""
    out = []
    async for message, decoded in read(stack.bootstrap, ReadPlan(topic_name(base, stack.namespace))):
        if isinstance(decoded, CodecError):
            out.append((message.value, {"undecodable": str(decoded)}))
        else:
            out.append((message.value, decoded.record))
    return out


def dataset(tasks: int, into: Path) -> Path:
    """The first ``tasks`` rows of the bundled swe-mini dataset (its images built first: idempotent)."""
    subprocess.run([sys.executable, str(DATASET.parent / "build.py")], check=True, capture_output=True)
    rows = [json.loads(line) for line in DATASET.read_text().splitlines() if line.strip()]
    # the demo's tasks first: their second sample fails by script, so their groups have reward variance
    # and train (the others solve twice and are skipped)
    rows.sort(key=lambda row: row["metadata"]["instance_id"] not in DEMO_TASKS)
    rows = rows[:tasks]
    for row in rows:  # the copy lives elsewhere: its paths must not be relative to it
        row["metadata"] = absolute_paths(row["metadata"], DATASET.parent)
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return into


def submit(stack: Stack, rows: Path, samples: int) -> None:
    argv = [sys.executable, "-m", "rollbus", "submit", str(rows), "--n-samples-per-prompt", str(samples),
            "--bootstrap-servers", stack.bootstrap, "--namespace", stack.namespace]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def pid_of(target: str, supervisor: Supervisor) -> int | None:
    if target == "broker":
        assert supervisor.broker is not None
        return supervisor.broker.pid() if supervisor.broker.is_running() else None  # type: ignore[attr-defined]
    child = supervisor[target]
    return child.proc.pid if child.running and child.proc is not None else None


def kill(target: str, supervisor: Supervisor) -> int:
    """SIGKILL, as a crash: the broker's JVM, or a service's whole process group (its sandboxes too)."""
    pid = pid_of(target, supervisor)
    assert pid is not None, f"{target} is not running"
    if target == "broker":
        os.kill(pid, signal.SIGKILL)
    else:
        os.killpg(pid, signal.SIGKILL)
    return pid


def whole(supervisor: Supervisor, target: str, killed: int) -> bool:
    """The killed part runs again (a new pid), every service runs (and answers, those with a health URL),
    and the broker answers."""
    pid = pid_of(target, supervisor)
    if pid is None or pid == killed or not all(child.running for child in supervisor.children):
        return False
    for child in supervisor.children:
        if child.spec.health_url and not healthy(child.spec.health_url):
            return False
    assert supervisor.broker is not None
    return supervisor.broker.is_running() and answers_metadata(supervisor.broker.bootstrap_servers)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def unwell(supervisor: Supervisor) -> str:
    """Which services are down or do not answer, with their logs' tails: what a timeout reports."""
    lines = []
    for child in supervisor.children:
        if not child.running or (child.spec.health_url and not healthy(child.spec.health_url)):
            lines.append(f"--- {child.spec.name} (running: {child.running})\n{child.log_tail(30)}")
    return "\n".join(lines) or "every service runs and answers"


async def rewarded(stack: Stack) -> set[str]:
    return {r["rollout_id"] for _, r in await topic(stack, "rewards") if "rollout_id" in r}


async def run_with_faults(
    state_dir: Path, *, tasks: int = 8, samples: int = 2, rounds: int = 1, seed: int = 0,
    timeout: float = 900.0, say: Callable[[str], None] = print,
) -> tuple[list[Kill], Verdict]:
    """``rounds`` times: submit ``tasks`` x ``samples`` rollouts and kill each target once while they run.
    Then wait until every rollout has a reward and the live segments equal a rebuild, and judge the bus."""
    rng = random.Random(seed)
    rows = dataset(tasks, state_dir / "tasks.jsonl")
    settings = StackSettings(
        state_dir=state_dir, namespace=NAMESPACE, gym=False, group_size=samples, rollout_batch_size=1,
        steps=0, runner_concurrency=2, ready_timeout=300, stop_grace=10,
    )  # fmt: skip
    kills: list[Kill] = []
    began = time.monotonic()
    async with running_stack(settings, lambda name, what: say(f"{name:15} {what}")) as (stack, supervisor):
        keeper = asyncio.create_task(supervisor.watch(poll=0.2))

        def alive() -> None:
            if keeper.done():  # the supervisor gave up: that is the finding
                keeper.result()
                raise AssertionError("the supervisor stopped watching")

        try:
            for number in range(rounds):
                await asyncio.to_thread(submit, stack, rows, samples)
                say(f"{'faults':15} round {number + 1}: {tasks * samples} rollouts submitted")
                for target in rng.sample(TARGETS, len(TARGETS)):
                    await asyncio.sleep(rng.uniform(0.5, 6.0))  # a seeded moment: mid-rollout, mid-step...
                    alive()
                    then = len(await rewarded(stack))
                    pid = kill(target, supervisor)
                    kills.append(Kill(target, pid, time.monotonic() - began, then))
                    say(f"{'faults':15} killed {target} (pid {pid}) at {kills[-1].at:.0f}s, {then} rewarded")

                    async def recovered(target: str = target, pid: int = pid) -> bool:
                        alive()
                        return await asyncio.to_thread(whole, supervisor, target, pid)

                    try:
                        await wait_until_async(recovered, timeout=300, interval=0.5, what=f"{target} back")
                    except TimeoutError:
                        raise AssertionError(f"{target} killed: the stack did not recover\n"
                                             f"{await asyncio.to_thread(unwell, supervisor)}") from None
            expected = {t["rollout_id"] for _, t in await topic(stack, "tasks")}

            async def all_rewarded() -> bool:
                alive()
                return expected <= await rewarded(stack)

            await wait_until_async(all_rewarded, timeout=timeout, interval=2.0, what="every rollout rewarded")
            verdict = await settle_and_judge(stack, supervisor, settings, alive, timeout)
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    return kills, verdict


async def settle_and_judge(
    stack: Stack, supervisor: Supervisor, settings: StackSettings, alive: Callable[[], None], timeout: float
) -> Verdict:
    """Wait until the live segments equal a rebuild from the raw topics (the segmenter caught up), and the
    trainer has taken every group it can; then judge."""
    attempt = 0

    async def caught_up() -> bool:
        nonlocal attempt
        alive()
        attempt += 1
        rebuilt = await asyncio.to_thread(rebuild, stack, f"{stack.namespace}.rebuilt-{attempt}")
        live = unique(await topic(stack, "segments"))
        again = unique(await topic_full(stack, f"{stack.namespace}.rebuilt-{attempt}"))
        return rebuilt["segments"] == len(again) and again == live

    await wait_until_async(caught_up, timeout=timeout, interval=3.0, what="live segments equal to a rebuild")
    trainable = trainable_groups(unique(await topic(stack, "segments")), settings.group_size)

    async def trained() -> bool:
        alive()
        return trainable <= {g for row in trainer_steps(settings) for g in row.get("group_ids", [])}

    await wait_until_async(trained, timeout=timeout, interval=2.0, what=f"groups {sorted(trainable)} trained")
    return judge(
        tasks=await topic(stack, "tasks"), rewards=await topic(stack, "rewards"),
        segments=await topic(stack, "segments"),
        rebuilt=await topic_full(stack, f"{stack.namespace}.rebuilt-{attempt}"),
        steps=trainer_steps(settings),
    )  # fmt: skip


async def topic_full(stack: Stack, name: str) -> list[tuple[bytes, dict[str, Any]]]:
    found = read(stack.bootstrap, ReadPlan(name))
    return [(m.value, d.record) async for m, d in found if not isinstance(d, CodecError)]


def rebuild(stack: Stack, into: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "rollbus", "rebuild", "segments", "--into", into,
            "--bootstrap-servers", stack.bootstrap, "--namespace", stack.namespace]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


REWARD = spec("reward").identity


def unique(segments: list[tuple[bytes, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {record["segment_id"]: record for _, record in segments}


def trainable_groups(segments: dict[str, dict[str, Any]], group_size: int) -> set[str]:
    """Groups whose every rollout has all its segments and whose rewards differ: the trainer takes them."""
    parts: dict[str, dict[str, set[int]]] = defaultdict(lambda: defaultdict(set))
    rewards: dict[str, dict[str, float]] = defaultdict(dict)
    for record in segments.values():
        parts[record["group_id"]][record["rollout_id"]].add(record["index"])
        rewards[record["group_id"]][record["rollout_id"]] = record["trajectory_reward"]
    numbers = {r["rollout_id"]: r["num_segments"] for r in segments.values()}
    return {
        group for group, rollouts in parts.items()
        if len(rollouts) == group_size and all(len(got) == numbers[r] for r, got in rollouts.items())
        and len(set(rewards[group].values())) > 1
    }  # fmt: skip


def trainer_steps(settings: StackSettings) -> list[dict[str, Any]]:
    metrics = settings.state_dir / "up" / "trainer" / settings.namespace / "metrics.jsonl"
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def judge(
    *, tasks: list[tuple[bytes, dict[str, Any]]], rewards: list[tuple[bytes, dict[str, Any]]],
    segments: list[tuple[bytes, dict[str, Any]]], rebuilt: list[tuple[bytes, dict[str, Any]]],
    steps: list[dict[str, Any]],
) -> Verdict:
    """The promises, over plain data: one reward per rollout, one content per segment id, one attempt per
    rollout's segments, each group trained at most once, the rebuild equal to the live topic."""
    verdict = Verdict()
    expected = {record["rollout_id"] for _, record in tasks}
    verdict.rollouts = len(expected)
    by_rollout: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for _, record in rewards:
        previous = by_rollout[record["rollout_id"]].setdefault(record.get("attempt_id", ""), record)
        if same_fact(REWARD, previous, record) == "conflict":
            verdict.problems.append(f"rollout {record['rollout_id']}: an attempt rewarded twice, differently")
    for rollout in sorted(expected):
        attempts = by_rollout.get(rollout, {})
        if len(attempts) != 1:
            verdict.problems.append(f"rollout {rollout}: rewarded attempts {sorted(attempts)}")
            continue
        (reward,) = attempts.values()
        verdict.rewards += 1
        if reward.get("failure_kind"):
            verdict.failures[reward["failure_kind"]] = verdict.failures.get(reward["failure_kind"], 0) + 1
    contents: dict[str, bytes] = {}
    attempts_of: dict[str, set[str]] = defaultdict(set)
    for raw, record in segments:
        if contents.setdefault(record["segment_id"], raw) != raw:
            verdict.problems.append(f"segment {record['segment_id']} published with two contents")
        attempts_of[record["rollout_id"]].add(record["attempt_id"])
    verdict.segments = len(contents)
    for rollout, seen in sorted(attempts_of.items()):
        if len(seen) != 1:
            verdict.problems.append(f"rollout {rollout}: segments of attempts {sorted(seen)}")
    live, again = unique(segments), unique(rebuilt)
    verdict.rebuilt = len(again)
    if live != again:
        verdict.problems.append(f"rebuild differs: {sorted(set(live) ^ set(again))[:10]} (or their contents)")
    trained: dict[str, int] = {}
    for row in steps:
        for group in row.get("group_ids", []):
            if group in trained:
                verdict.problems.append(f"group {group} trained at steps {trained[group]} and {row['step']}")
            trained[group] = row["step"]
    verdict.steps, verdict.groups_trained = len(steps), len(trained)
    if [row["step"] for row in steps] != list(range(1, len(steps) + 1)):
        verdict.problems.append(f"steps logged {[row['step'] for row in steps]}: a step repeated or lost")
    return verdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds: a submission, every part killed once")
    parser.add_argument("--tasks", type=int, default=10, help="dataset rows per round (at most 10)")
    parser.add_argument("--samples", type=int, default=2, help="rollouts per row (one group)")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--state-dir", type=Path, default=None, help="kept afterwards (default: a temp dir)")
    args = parser.parse_args(argv)
    state = args.state_dir or Path(tempfile.mkdtemp(prefix="rollbus-soak-"))
    print(f"soak: seed {args.seed}, state dir {state}", flush=True)
    kills, verdict = asyncio.run(run_with_faults(
        state, tasks=args.tasks, samples=args.samples, rounds=args.rounds, seed=args.seed,
        timeout=600.0 * args.rounds, say=lambda line: print(line, flush=True),
    ))  # fmt: skip
    print(f"killed {len(kills)} times:")
    for k in kills:
        print(f"  {k.at:7.1f}s  {k.target:15} pid {k.pid:<8} ({k.rewards_then} rollouts rewarded then)")
    print(f"checked: {verdict.rollouts} rollouts, {verdict.rewards} with exactly one rewarded attempt "
          f"(failures {verdict.failures}); {verdict.segments} segment ids, one content each, one attempt per "
          f"rollout; rebuild {verdict.rebuilt} == live {verdict.segments}; {verdict.steps} steps, "
          f"{verdict.groups_trained} groups trained at most once")  # fmt: skip
    for problem in verdict.problems:
        print(f"PROBLEM: {problem}")
    return 1 if verdict.problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
