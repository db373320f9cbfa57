"""Gym rows end to end over the real broker: tasks -> gym runner -> adapter (OpenAI route) -> rollbus engine
(scripted, examples/scripts/gym/math_lake.json) -> turns, sessions, rewards on the bus.

All parts are real: Kafka (conftest), the engine process, the adapter app on a port, the runner's ``serve``
loop in this event loop (so a test can stop it like SIGTERM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest

from rollbus.commands.export import ExportSettings, export_completions
from rollbus.events import TaskEvent
from rollbus.kafka.broker import free_port
from rollbus.kafka.bus import Publisher
from rollbus.kafka.replay import ReadPlan, read
from rollbus.services.adapter.app import create_app
from rollbus.services.gym_runner import gym
from rollbus.services.gym_runner.main import serve
from rollbus.services.gym_runner.runner import EpisodeResult, reward_record
from rollbus.services.gym_runner.settings import GymRunnerSettings
from rollbus.trajectory import fan_out
from rollbus.turn_log import frozen_chains, resolve_turns
from tests.e2e_support import SCRIPTS
from tests.runner_support import group_lag
from tests.test_adapter_support import served, settings
from tests.waiting import count_polls, until

pytestmark = pytest.mark.kafka
SCRIPT = json.loads((SCRIPTS / "gym" / "math_lake.json").read_text())
HOLEY = ["SFFF", "FFFF", "FHFF", "FFFG"]


@contextlib.asynccontextmanager
async def stack(bootstrap: str, namespace: str, engine_url: str, **runner: Any):
    """The adapter (publishing to ``namespace``) and a runner (unless ``in_process=False``); yields the
    runner's stop event, a publisher and the adapter's URL."""
    async with Publisher(bootstrap) as publisher:
        adapter_settings = settings(engine_url, admin_token="adm", open_sessions=False, namespace=namespace)
        app = create_app(adapter_settings, publisher)
        async with app.router.lifespan_context(app), served(app) as (url, _):
            config = {"bootstrap_servers": bootstrap, "namespace": namespace, "adapter_url": url,
                      "admin_token": "adm", "max_tokens": 64, "concurrency": 3, **runner}  # fmt: skip
            config.pop("in_process", None)
            stop = asyncio.Event()
            if runner.get("in_process", True):
                task = asyncio.create_task(serve(GymRunnerSettings.load(config), stop))
            else:
                task = asyncio.create_task(stop.wait())
            try:
                yield stop, publisher, url
            finally:
                stop.set()
                await task


def task(rollout_id: str, env_config: dict | None, **extra: Any) -> TaskEvent:
    return TaskEvent(**{
        "rollout_id": rollout_id, "group_id": extra.pop("group_id", "g-" + rollout_id), "sample_index": 0,
        "group_size": extra.pop("group_size", 1), "prompt": "", "label": None, "metadata": "{}",
        "submitted_at": int(time.time() * 1000),
        "env_config": json.dumps(env_config) if env_config is not None else None,
        "ctx_config": json.dumps(extra.pop("ctx_config")) if "ctx_config" in extra else None,
        "messages": json.dumps([{"role": "user", "content": "play"}]),
    })  # fmt: skip


async def events(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    found = []
    async for _, decoded in read(bootstrap, ReadPlan(topic, "beginning")):
        assert not isinstance(decoded, Exception), decoded
        found.append(decoded.record)
    return found


async def rewards_for(
    bootstrap: str, topic: str, rollouts: set[str], deadline: float = 240.0, log: Any = None
) -> dict:
    """Poll ``rewards`` until every rollout has one (the deadline only guards against a hang)."""
    got: dict[str, dict] = {}

    async def all_rewarded() -> bool:
        found = await events(bootstrap, topic)
        got.update({r["rollout_id"]: r for r in found if r["rollout_id"] in rollouts})
        return set(got) == rollouts

    await until(all_rewarded, f"rewards of {sorted(rollouts)}", timeout=deadline, interval=0.5, log=log)
    return got


async def test_gym_rows_get_the_rewards_their_scripted_episodes_earn(
    kafka_bootstrap, topics, engine_url, tmp_path
):
    namespace = topics["tasks"].rsplit(".", 1)[0]
    ids = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in
           ("first", "retry", "wrong", "lake", "hole", "bad", "coding")}  # fmt: skip
    rows = [
        task(ids["first"], {"name": "math", "seed": 2}, group_id="g-math", group_size=3),
        task(ids["retry"], {"name": "math", "seed": 11}, group_id="g-math", group_size=3),
        task(ids["wrong"], {"name": "math", "seed": 4}, group_id="g-math", group_size=3),
        task(ids["lake"], {"name": "frozen_lake"}, ctx_config={"name": "window", "keep": 2}),
        task(ids["hole"], {"name": "frozen_lake", "map": HOLEY}),
        task(ids["bad"], {"name": "chess", "depth": 3}),
        task(ids["coding"], None),
    ]
    async with stack(kafka_bootstrap, namespace, engine_url) as (_, publisher, _url):
        for row in rows:
            await publisher.publish(topics["tasks"], row)
        wanted = set(ids.values()) - {ids["coding"]}
        rewards = await rewards_for(kafka_bootstrap, topics["rewards"], wanted)
    assert set(rewards) == wanted  # and nothing for the coding task (checked below, all rewards read)
    expect = {  # rollout -> (reward, step_rewards, failure_kind, solved)
        "first": (1.0, [1.0], None, True),
        "retry": (0.5, [0.0, 0.5], None, True),
        "wrong": (0.0, [0.0, 0.0], None, False),
        "lake": (1.0, [0.0] * 5 + [1.0], None, True),
        "hole": (0.0, [0.0] * 3, None, False),
        "bad": (0.0, [], "bad_env_config", False),
    }
    for name, (reward, steps, failure, solved) in expect.items():
        record = rewards[ids[name]]
        got = (record["reward"], record["step_rewards"], record["failure_kind"], record["solved"])
        assert got == (reward, steps, failure, solved), (name, record["details"])
        infos = json.loads(record["infos"])
        assert len(infos) == (1 + len(steps) if failure is None else 0), name
        assert json.loads(record["details"])["loss_scope"] == "all_turns"
    assert rewards[ids["first"]]["group_id"] == "g-math" and rewards[ids["first"]]["group_size"] == 3
    bad = json.loads(rewards[ids["bad"]]["details"])
    assert "'chess' is not registered; registered: " in bad["error"]
    listed = bad["error"].split("registered: ")[1].split(", ")
    assert {"frozen_lake", "math", "python_tool"} <= set(listed) and listed == sorted(listed)
    retry_infos = json.loads(rewards[ids["retry"]]["infos"])
    assert retry_infos[0]["question"] == "Solve for x: 9x + 2 = 20" and retry_infos[1]["given"] == "24"
    all_rewards = await events(kafka_bootstrap, topics["rewards"])
    assert ids["coding"] not in {r["rollout_id"] for r in all_rewards}

    turns = await events(kafka_bootstrap, topics["turns"])
    sessions = await events(kafka_bootstrap, topics["sessions"])
    await check_lake_wipes(ids["lake"], rewards[ids["lake"]], turns, sessions)
    math_turns = [t for t in turns if t["rollout_id"] == ids["retry"]]
    assert [(t["chain_id"], t["turn_index"], t["prompt_ref_turn"]) for t in math_turns] == [
        ("main", 0, None), ("main", 1, 0)  # the retry extends the chain token for token
    ]  # fmt: skip
    closed = [s for s in sessions if s["rollout_id"] == ids["retry"] and s["kind"] == "closed"]
    assert [s["chain_id"] for s in closed] == ["main"]  # the runner closed the session

    out = tmp_path / "completions.jsonl"
    config = {"bootstrap_servers": kafka_bootstrap, "namespace": namespace, "out": str(out), "failed": "skip"}
    assert await export_completions(ExportSettings.load(config)) == (5, 0)
    lines = {line["rollout_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    retry = lines[ids["retry"]]
    assert retry["env_config"] == {"name": "math", "seed": 11} and retry["step_rewards"] == [0.0, 0.5]
    assert [m["role"] for m in retry["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert retry["messages"][-1]["content"] == "<move>down</move> <answer>2</answer>"
    assert len(retry["trajectory_infos"]) == 3 and retry["reward"] == 0.5
    assert lines[ids["lake"]]["ctx_config"] == {"name": "window", "keep": 2}


async def check_lake_wipes(rollout: str, reward: dict, turns: list[dict], sessions: list[dict]) -> None:
    """The window context manager rewrote the history before turns 3..6: each rewrite froze the chain."""
    mine = [t for t in turns if t["rollout_id"] == rollout]
    chains = [t["chain_id"] for t in mine]
    assert chains == ["main", "main", "main.1", "main.2", "main.3", "main.4"]
    frozen = [
        (s["chain_id"], s["reason"]) for s in sessions if s["rollout_id"] == rollout and s["kind"] == "frozen"
    ]
    assert [c for c, _ in frozen] == ["main", "main.1", "main.2", "main.3"] and all(r for _, r in frozen)
    kinds = {t["chain_id"]: t["chain_kind"] for t in mine}
    scope = json.loads(reward["details"])["loss_scope"]
    segments = fan_out(frozen_chains(resolve_turns(mine), kinds), rollout, reward["reward"], loss_scope=scope)
    assert [s.kind for s in segments] == ["wipe"] * 4 + ["final"]
    assert sum(s.reward for s in segments) == pytest.approx(1.0)
    assert all(sum(s.loss_mask) > 0 for s in segments)


# ---------------------------------------------------------------- failures, timeouts, shutdown

STARTED: list[asyncio.Event] = []
CLOSED: list[str] = []


@gym.register_env("stuck-test")
class Stuck(gym.Env):
    """Answers reset, then never finishes a step: the runner must time it out or cancel it."""

    async def reset(self, request):
        return "wait", {"rollout": request.rollout_id}, ""

    async def step(self, messages):
        for event in STARTED:
            event.set()
        await asyncio.Event().wait()

    async def close(self):
        CLOSED.append(self.env_config["tag"])


async def test_timeouts_are_retried_then_fail_and_every_env_is_closed(kafka_bootstrap, topics, engine_url):
    namespace = topics["tasks"].rsplit(".", 1)[0]
    rollout, tag = f"slow-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    runner = {"episode_timeout": 1.0, "attempts": 2}
    async with stack(kafka_bootstrap, namespace, engine_url, **runner) as (_, publisher, _url):
        await publisher.publish(topics["tasks"], task(rollout, {"name": "stuck-test", "tag": tag}))
        reward = (await rewards_for(kafka_bootstrap, topics["rewards"], {rollout}))[rollout]
    assert reward["failure_kind"] == "timeout" and json.loads(reward["details"])["attempts"] == 2
    assert CLOSED.count(tag) == 2  # one env per attempt, each closed once
    assert reward["attempt_id"].startswith(f"{rollout}.a2.")


async def test_shutdown_loses_nothing(kafka_bootstrap, topics, engine_url, monkeypatch):
    """SIGTERM with one episode running and one task waiting for the only slot: the running episode's env and
    session are closed; neither task is committed. The next runner of the group gets both (here they time
    out, so each ends with exactly one reward)."""
    namespace = topics["tasks"].rsplit(".", 1)[0]
    (running, waiting), tags = (
        [f"stop-{uuid.uuid4().hex[:6]}" for _ in range(2)],
        [uuid.uuid4().hex for _ in "ab"],
    )
    stepping = asyncio.Event()
    STARTED.append(stepping)
    first = {"drain_timeout": 0.1, "concurrency": 1}
    polls = count_polls(monkeypatch)
    try:
        async with stack(kafka_bootstrap, namespace, engine_url, **first) as (stop, publisher, _url):
            await publisher.publish(topics["tasks"], task(running, {"name": "stuck-test", "tag": tags[0]}))
            await asyncio.wait_for(stepping.wait(), 120)
            await publisher.publish(topics["tasks"], task(waiting, {"name": "stuck-test", "tag": tags[1]}))
            ended = polls[0]
            # the runner has polled again since: it has seen the waiting task (it waits for the slot)
            await until(lambda: polls[0] >= ended + 2, "two more polls")
            stop.set()  # what SIGTERM does
    finally:
        STARTED.remove(stepping)
    assert (CLOSED.count(tags[0]), CLOSED.count(tags[1])) == (1, 0)
    tasks = [t["rollout_id"] for t in await events(kafka_bootstrap, topics["tasks"])]
    assert (tasks.count(running), tasks.count(waiting)) == (1, 1)  # redelivered, not published again
    assert not {running, waiting} & {
        r["rollout_id"] for r in await events(kafka_bootstrap, topics["rewards"])
    }
    sessions = [s for s in await events(kafka_bootstrap, topics["sessions"]) if s["rollout_id"] == running]
    assert [s["kind"] for s in sessions] == ["opened", "closed"]  # the adapter session was closed too

    second = {"episode_timeout": 0.5, "attempts": 1}
    async with stack(kafka_bootstrap, namespace, engine_url, **second) as (_, _publisher, _url):
        await rewards_for(kafka_bootstrap, topics["rewards"], {running, waiting})
    rewards = [
        r for r in await events(kafka_bootstrap, topics["rewards"]) if r["rollout_id"] in (running, waiting)
    ]
    assert sorted((r["rollout_id"], r["failure_kind"]) for r in rewards) == sorted(
        [(running, "timeout"), (waiting, "timeout")]
    )
    assert (CLOSED.count(tags[0]), CLOSED.count(tags[1])) == (2, 1)


async def test_the_rollbus_gym_runner_command_runs_episodes_and_stops_on_sigterm(
    kafka_bootstrap, topics, engine_url, tmp_path
):
    """The real command lines: ms-swift rows submitted by ``rollbus gym-submit``, episodes run by
    ``rollbus gym-runner`` (flags and variables), which exits 0 on SIGTERM."""
    namespace = topics["tasks"].rsplit(".", 1)[0]
    dataset = tmp_path / "swift.jsonl"
    good = {"messages": [{"role": "user", "content": "solve"}], "env_config": {"name": "math", "seed": 2},
            "solution": "24"}  # fmt: skip
    dataset.write_text(json.dumps(good) + "\n" + "[1]\n")
    common = ["--bootstrap-servers", kafka_bootstrap, "--namespace", namespace]
    submitted = subprocess.run([sys.executable, "-m", "rollbus", "gym-submit", str(dataset), *common],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    assert submitted.returncode == 1, submitted.stderr  # one row skipped
    assert "swift.jsonl:2: a row is a JSON object, not list; skipped" in submitted.stderr
    (task,) = [
        t for t in await events(kafka_bootstrap, topics["tasks"]) if t["group_id"].startswith("swift-1-")
    ]
    assert json.loads(task["metadata"]) == {"solution": "24"} and task["prompt"] == "solve"
    rollout = task["rollout_id"]
    async with stack(kafka_bootstrap, namespace, engine_url, in_process=False) as (_, publisher, url):
        env = {**os.environ, "ROLLBUS_GYM_RUNNER_ADMIN_TOKEN": "adm", "ROLLBUS_NAMESPACE": namespace}
        log = (tmp_path / "gym-runner.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollbus", "gym-runner", "--bootstrap-servers", kafka_bootstrap,
             "--adapter-url", url, "--max-tokens", "64", "--loss-scope", "last_turn"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            reward = (await rewards_for(kafka_bootstrap, topics["rewards"], {rollout}))[rollout]
        finally:
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 60)
            log.close()
    assert code == 0, (tmp_path / "gym-runner.log").read_text()
    assert reward["reward"] == 1.0 and json.loads(reward["details"])["loss_scope"] == "last_turn"


HELD_ENV = '''
import asyncio
import pathlib

from rollbus.services.gym_runner import gym


@gym.register_env("held-test")
class Held(gym.Env):
    """Marks its first step as begun, then holds it until the test's release file exists."""

    async def reset(self, request):
        return "wait", {}, ""

    async def step(self, messages):
        pathlib.Path(self.env_config["begun"]).touch()
        while not pathlib.Path(self.env_config["release"]).exists():
            await asyncio.sleep(0.05)
        return "", 1.0, True, {}
'''


async def test_a_runner_killed_mid_episode_leaves_its_task_to_the_next(
    kafka_bootstrap, topics, engine_url, tmp_path
):
    """``kill -9`` of ``rollbus gym-runner`` while its episode holds in a step: the task was not committed, so
    the next runner of the group runs the episode again as a new attempt and publishes its one reward; the
    killed attempt's adapter session is closed by the new attempt."""
    namespace = topics["tasks"].rsplit(".", 1)[0]
    rollout, group = f"held-{uuid.uuid4().hex[:6]}", f"gym-kill-{uuid.uuid4().hex[:6]}"
    plugin, begun, release = tmp_path / "held.py", tmp_path / "begun", tmp_path / "release"
    plugin.write_text(HELD_ENV)
    config = {"name": "held-test", "begun": str(begun), "release": str(release)}
    async with stack(kafka_bootstrap, namespace, engine_url, in_process=False) as (_, publisher, url):
        env = {**os.environ, "ROLLBUS_GYM_RUNNER_ADMIN_TOKEN": "adm", "ROLLBUS_NAMESPACE": namespace}

        def runner(name: str) -> subprocess.Popen[bytes]:
            with (tmp_path / f"{name}.log").open("wb") as log:
                return subprocess.Popen(
                    [sys.executable, "-m", "rollbus", "gym-runner", "--bootstrap-servers", kafka_bootstrap,
                     "--adapter-url", url, "--max-tokens", "64", "--external-plugins", str(plugin),
                     "--consumer-group", group],
                    stdout=log, stderr=subprocess.STDOUT, env=env,
                )  # fmt: skip

        await publisher.publish(topics["tasks"], task(rollout, config))
        first = runner("first")
        try:
            def first_begun() -> bool:
                assert first.poll() is None, (tmp_path / "first.log").read_text()
                return begun.exists()

            await until(first_begun, "the first runner's episode begun", timeout=180, interval=0.1)
        finally:
            first.kill()
            await asyncio.to_thread(first.wait, 60)
        release.touch()
        second = runner("second")
        try:
            second_log = (tmp_path / "second.log").read_text
            got = await rewards_for(
                kafka_bootstrap, topics["rewards"], {rollout}, deadline=180, log=second_log
            )
        finally:
            second.send_signal(signal.SIGTERM)
            await asyncio.to_thread(second.wait, 60)
    assert rollout in got, (tmp_path / "second.log").read_text()[-3000:]
    rewards = [r for r in await events(kafka_bootstrap, topics["rewards"]) if r["rollout_id"] == rollout]
    assert len(rewards) == 1 and rewards[0]["reward"] == 1.0 and rewards[0]["failure_kind"] is None
    sessions = [s for s in await events(kafka_bootstrap, topics["sessions"]) if s["rollout_id"] == rollout]
    opened = [s["attempt_id"] for s in sessions if s["kind"] == "opened"]
    assert len(opened) == 2 and rewards[0]["attempt_id"] == opened[1], "the re-run is a new attempt"
    assert {s["attempt_id"] for s in sessions if s["kind"] == "closed"} == set(opened)


async def test_a_task_whose_reward_is_on_the_bus_is_committed_and_not_run_again(kafka_bootstrap, topics):
    """A runner killed after publishing ``done``'s reward and before committing it: the next one reads
    ``rewards``, commits ``done`` without an episode, and runs ``next`` (a bad env config: it ends at once,
    no adapter needed). On the code before, ``done`` ran again and was rewarded twice."""
    namespace = topics["tasks"].rsplit(".", 1)[0]
    done, later, group = task("done", [1, 2]), task("next", [1, 2]), f"gym-answered-{uuid.uuid4().hex[:6]}"
    killed = EpisodeResult(gym.Episode(step_rewards=[1.0]), "done.a1.killed", 1, None, "math")
    config = {"bootstrap_servers": kafka_bootstrap, "namespace": namespace, "consumer_group": group,
              "adapter_url": f"http://127.0.0.1:{free_port()}", "admin_token": "adm"}  # fmt: skip
    async with Publisher(kafka_bootstrap) as publisher:
        await publisher.publish(topics["rewards"], reward_record(done, killed, "all_turns"))
        await publisher.publish_many(topics["tasks"], [done, later])
    stop = asyncio.Event()
    runner = asyncio.create_task(serve(GymRunnerSettings.load(config), stop))
    try:

        async def both_committed() -> bool:  # next's reward was published before its commit
            assert not runner.done(), runner
            return not await group_lag(kafka_bootstrap, namespace, group)

        await until(both_committed, "both tasks committed", timeout=180, interval=0.5)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 60)
    rewards = sorted(await events(kafka_bootstrap, topics["rewards"]), key=lambda r: r["rollout_id"])
    expected = [("done", None), ("next", "bad_env_config")]
    assert [(r["rollout_id"], r["failure_kind"]) for r in rewards] == expected
    assert rewards[0]["attempt_id"] == "done.a1.killed"
