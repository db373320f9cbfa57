"""``rollbus demo``: the closed loop on embedded defaults: rollouts in, a trained policy out, served.

Starts the stack of ``rollbus up`` (broker, engine with a scripted policy, adapter, sandbox runner, grader,
segmenter, trainer) and runs one round per training step: it submits the dataset (``--n-samples-per-prompt``
rollouts per row: one group each; the trainer steps once all of a round's groups are complete), waits for the
step to be published and for the engine to serve it, then starts the next round, whose turns therefore carry
the new policy version. Progress is folded live from the bus. Ends with a summary; ``--json-summary OUT`` also
writes it as JSON.

Each demo is a run of its own: a new topic namespace (``demo-<time>-<hex>``, so its own topics, segmenter
tables and trainer checkpoints on the same broker and state dir), named in its first line. ``--resume``
continues the last demo run of the state dir, ``--namespace NAME`` a named one; either way the summary counts
only what this invocation did, and its steps come after the run's newest policy version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table
from rich.text import Text

from rollbus.demo_runs import NoEarlierRun, record_demo
from rollbus.events import RewardEvent
from rollbus.services.stack.progress import Progress, watch
from rollbus.services.stack.settings import DemoSettings
from rollbus.services.stack.supervisor import Supervisor
from rollbus.services.stack.up import Stack, running_stack
from rollbus.settings import SettingsError

console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)


async def demo(settings: DemoSettings) -> dict[str, Any]:
    say = lambda name, what: console.print(Text(f"{name:15} {what}"))  # noqa: E731
    started_ms = int(time.time() * 1000)  # what the topics hold from before is an earlier run's
    namespace, how = settings.run_namespace()
    record_demo(settings.state_dir / "up", namespace)
    checkpoints = settings.state_dir / "up" / "trainer" / (namespace or "default")
    say("demo", f"run {namespace or '(no namespace)'} ({how}): its topics {namespace}.*, trainer checkpoints "
                f"in {checkpoints}; `rollbus demo --resume` continues it")  # fmt: skip
    await asyncio.to_thread(prepare, settings.tasks)
    groups = rows_in(settings.tasks)
    # one step per round; the trainer runs until the demo stops it (its --steps counts across runs)
    stack_settings = settings.model_copy(
        update={"rollout_batch_size": groups, "namespace": namespace, "steps": 0}
    )
    async with running_stack(stack_settings, say) as (stack, supervisor):
        progress, stop = Progress(), asyncio.Event()
        watcher = asyncio.create_task(
            watch(stack.bootstrap, stack.namespace, progress, stop, since_ms=started_ms)
        )
        keeper = asyncio.create_task(supervisor.watch())
        try:
            await rounds(settings, stack, supervisor, progress)
            served = await served_version(stack)
            console.print(Text(f"{'engine':15} serving weight version {served}"))
        finally:
            stop.set()
            keeper.cancel()
            await asyncio.gather(watcher, keeper, return_exceptions=True)
    trained = tokens_trained(stack_settings, progress.policy_base)
    summary: dict[str, Any] = progress.summary(train_steps=progress.policy_updates, tokens_trained=trained)
    if settings.moe:
        summary.update(routing_figures(step_rows(stack_settings, progress.policy_base)))
    show(stack_settings, progress, summary, stack)
    if settings.json_summary is not None:
        settings.json_summary.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


async def rounds(settings: DemoSettings, stack: Stack, supervisor: Supervisor, progress: Progress) -> None:
    """One round per training step: submit the dataset, wait for its step and for the engine to serve it,
    so every round after the first generates with the policy the previous rounds trained, and the demo
    ends with the engine serving the last policy (the trainer publishes it before the push lands)."""
    started = time.monotonic()
    for number in range(1, max(1, settings.steps) + 1):
        await asyncio.to_thread(submit, settings, stack)
        deadline = settings.timeout - (time.monotonic() - started)
        if not await follow(settings, progress, deadline, steps=number if settings.steps else 0):
            return
        if settings.steps:  # the last round's too: the demo ends serving the policy it trained
            await wait_served(stack, progress.policy_base + number, deadline)


def rows_in(dataset: Path) -> int:
    """The tasks ``rollbus submit`` will read from ``dataset`` (any format it reads, Harbor folders too)."""
    from rollbus.task_formats import load_dataset

    return sum(1 for loaded in load_dataset(dataset) if loaded.text is not None)


async def wait_served(stack: Stack, version: int, timeout: float) -> None:
    """Until the engine generates with ``version`` (the trainer publishes, then pushes the weights)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        served = await served_version(stack)
        if served.isdigit() and int(served) >= version:
            console.print(Text(f"{'engine':15} now serving weight version {served}"))
            return
        await asyncio.sleep(1.0)


def prepare(dataset: Path) -> None:
    """A dataset that ships a ``build.py`` beside it (swe-mini: its images are git repositories made from
    plain files) is built first; the script is idempotent."""
    build = dataset.resolve().parent / "build.py"
    if build.exists():
        subprocess.run([sys.executable, str(build)], check=True, capture_output=True)


def submit(settings: DemoSettings, stack: Stack) -> None:
    """``rollbus submit``, exactly as a user would run it."""
    argv = [sys.executable, "-m", "rollbus", "submit", str(settings.tasks),
            "--n-samples-per-prompt", str(settings.n_samples_per_prompt + settings.over_sample),
            "--bootstrap-servers", stack.bootstrap, "--namespace", stack.namespace]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    console.print(Text(f"{'submit':15} {(done.stdout + done.stderr).strip()}"))
    if done.returncode == 2:
        raise SystemExit("rollbus demo: nothing could be submitted")


async def follow(settings: DemoSettings, progress: Progress, timeout: float, steps: int) -> bool:
    """Print progress as it changes until ``steps`` steps are published (or, with 0, every rollout ended);
    False when that cannot happen any more (everything ended and nothing moved for a while, or time is up)."""
    started = last_change = time.monotonic()
    shown = ""
    while time.monotonic() - started < timeout:
        await asyncio.sleep(1.0)
        line = progress.line()
        if line != shown:
            console.print(Text(f"{'progress':15} {line}"))
            shown, last_change = line, time.monotonic()
        ended = progress.submitted and progress.finished >= len(progress.submitted)
        if steps and progress.policy_updates >= steps:
            return True
        if ended and not steps:
            return True
        if ended and time.monotonic() - last_change > settings.idle_timeout:
            console.print(Text(f"{'demo':15} every rollout ended; the trainer made {progress.policy_updates} "
                               f"of {steps} steps (groups without reward variance are skipped)"))
            return False
    console.print(Text(f"{'demo':15} timed out after {settings.timeout:.0f}s"))
    return False


async def served_version(stack: Stack) -> str:
    """The weight version the engine generates with now (the trainer's last push, once it landed)."""
    async with httpx.AsyncClient(timeout=10.0) as http:
        answer = await http.get(
            f"{stack.engine_url}/get_model_info", headers={"authorization": f"Bearer {stack.engine_key}"}
        )
    return str(answer.json().get("weight_version")) if answer.status_code == 200 else f"unknown ({answer})"


def step_rows(settings: DemoSettings, base_version: int) -> list[dict[str, Any]]:
    """The trainer's metrics rows of this run's steps (an earlier run's steps are in the same file)."""
    metrics = settings.state_dir / "up" / "trainer" / (settings.namespace or "default") / "metrics.jsonl"
    if not metrics.exists():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [row for row in rows if int(row.get("version", 0)) > base_version]


def tokens_trained(settings: DemoSettings, base_version: int) -> int | None:
    """Tokens the steps of this run trained."""
    return sum(int(row.get("tokens_trained", 0)) for row in step_rows(settings, base_version))


ROUTING_FIGURES = (
    ("replayed_fraction", "routing_replayed_fraction"),  # trained tokens on the rollout's routing
    ("routing_agreement", "routing_agreement"),  # replayed positions the trainer would have routed alike
    ("logprob_diff_mean", "logprob_diff_mean"),
    ("logprob_diff_max", "logprob_diff_max"),
    ("approx_kl", "approx_kl"),
    ("unreplayed_logprob_diff_mean", "unreplayed_logprob_diff_mean"),  # the same tokens, its own routing
    ("unreplayed_approx_kl", "unreplayed_approx_kl"),
)


def routing_figures(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """``--moe``: each routing and mismatch figure of the trainer's steps, averaged over this run's steps
    (the max of the maxima); None for a figure no step reported."""
    figures: dict[str, float | None] = {}
    for key, name in ROUTING_FIGURES:
        values = [float(row[key]) for row in rows if row.get(key) is not None]
        combine = max if key.endswith("_max") else (lambda v: sum(v) / len(v))
        figures[name] = combine(values) if values else None
    return figures


def show(settings: DemoSettings, progress: Progress, summary: dict[str, Any], stack: Stack) -> None:
    table = Table(title="rollouts")
    for column in ("rollout", "attempt", "reward", "solved", "failure", "flags"):
        table.add_column(column, overflow="fold")
    for rollout_id, reward in sorted(progress.rewards.items()):
        table.add_row(
            Text(rollout_id), Text(reward.attempt_id), f"{reward.reward:.2f}",
            "yes" if reward.solved else "no", Text(failure_shown(reward)), Text(",".join(reward.flags)),
        )  # fmt: skip
    console.print(table)
    for rollout_id, reward in sorted(progress.rewards.items()):
        if note := failure_note(reward):
            console.print(Text(f"{rollout_id}: {note}"))
    versions = sorted(set(progress.turn_policy_versions))
    console.print(Text(f"policy versions that generated turns: {versions}"))
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        console.print(Text(f"{key:20} {shown}"))
    console.print(Text(f"logs: {stack.log_dir}"))
    if progress.rewards:
        embedded = settings.state_dir / "up" if settings.starts_broker() else None
        first = sorted(progress.rewards)[0]
        console.file.flush()
        print(replay_hint(first, stack.bootstrap, embedded, stack.namespace), flush=True)  # whole lines


def failure_shown(reward: RewardEvent) -> str:
    """The grader's failure kind, with the runner's own when the rollout failed before grading."""
    kind = reward.failure_kind or ""
    runner = details(reward).get("rollout_failure")
    return f"{kind} ({runner})" if kind and isinstance(runner, str) else kind


def failure_note(reward: RewardEvent, limit: int = 600) -> str:
    """What the runner said of a rollout that failed before grading (the CLI's last words), else ""."""
    if not isinstance(details(reward).get("rollout_failure"), str):
        return ""
    note = details(reward).get("note")
    return " ".join(note.split())[-limit:] if isinstance(note, str) else ""


def details(reward: RewardEvent) -> dict[str, Any]:
    try:
        found = json.loads(reward.details or "{}")
    except (TypeError, json.JSONDecodeError):
        return {}
    return found if isinstance(found, dict) else {}


def replay_hint(rollout_id: str, bootstrap: str, embedded_state: Path | None, namespace: str = "") -> str:
    """The commands that replay a rollout after the demo, true for the broker it used: its own embedded one
    (stopped by now: start it again from its state dir, which records its port) or the cluster given."""
    replay = f"rollbus replay turns --key {shlex.quote(rollout_id)} --format table"
    if namespace:
        replay += f" --namespace {shlex.quote(namespace)}"
    if embedded_state is None:
        return f"replay it yourself: {replay} --bootstrap-servers {shlex.quote(bootstrap)}"
    state = shlex.quote(str(embedded_state))
    return (
        f"replay it yourself (the demo's broker stopped with it):\n"
        f"  rollbus broker start --state-dir {state}\n"
        f"  {replay} --state-dir {state}\n"
        f"  rollbus broker stop --state-dir {state}"
    )


add_arguments = DemoSettings.add_arguments
__all__ = ["DemoSettings"]  # its home is settings.py (light, for --help)


async def cancellable(settings: DemoSettings) -> dict[str, Any]:
    """The demo, cancelled by SIGTERM or SIGINT so every service is stopped on the way out."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    return await demo(settings)


def run(args: argparse.Namespace) -> int:
    settings = DemoSettings.from_args(args)
    try:
        summary = asyncio.run(cancellable(settings))
    except NoEarlierRun as exc:
        raise SettingsError(str(exc)) from None
    except asyncio.CancelledError:
        console.print(Text("rollbus demo: interrupted; every service was stopped"))
        return 130
    all_ended = summary["rollouts_finished"] == summary["rollouts_submitted"]
    return 0 if all_ended and summary["train_steps"] >= settings.steps else 1
