"""The gym runner's task -> reward path without the broker: the real adapter app (OpenAI route) and engine
for the python_tool env's tool round trip, a closed port for an unreachable adapter, and the reward record."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import rollbus.services.gym_runner.envs  # noqa: F401  (registers the built-ins)
from rollbus.codec import encode
from rollbus.events import RewardEvent, TaskEvent
from rollbus.kafka.broker import free_port
from rollbus.services.adapter.app import create_app
from rollbus.services.gym_runner import gym
from rollbus.services.gym_runner.adapter_client import AdapterClient
from rollbus.services.gym_runner.gym import Episode, GymConfigError
from rollbus.services.gym_runner.runner import MAX_DETAILS_CHARS, EpisodeResult, GymRunner, reward_record
from rollbus.services.gym_runner.settings import GymRunnerSettings
from rollbus.services.gym_runner.submit import parse_row, tasks_for
from tests.e2e_support import SCRIPTS
from tests.test_adapter_support import BusPublisher, engine_process, served, settings

CLOSES: list[str] = []


@gym.register_env("counted-test")
class Counted(gym.Env):
    async def reset(self, request):
        return "hi", {}, ""

    async def step(self, messages):
        return "", 1.0, True, {}

    async def close(self):
        CLOSES.append(self.env_config["tag"])


def task(rollout: str, env_config: Any, **extra: Any) -> TaskEvent:
    raw = env_config if isinstance(env_config, str) else json.dumps(env_config)
    fields = {"rollout_id": rollout, "group_id": "g", "sample_index": 0, "group_size": 2, "prompt": "",
              "metadata": "{}", "submitted_at": 0, "env_config": raw, **extra}  # fmt: skip
    return TaskEvent(**fields)


class Collected:
    def __init__(self) -> None:
        self.records: list[tuple[str, RewardEvent]] = []

    async def __call__(self, topic: str, record: RewardEvent) -> None:
        self.records.append((topic, record))


def runner_for(url: str, **overrides: Any) -> tuple[GymRunner, Collected, httpx.AsyncClient]:
    config = GymRunnerSettings.load(
        {"adapter_url": url, "admin_token": "adm", "max_tokens": 128, **overrides}
    )
    http = httpx.AsyncClient(base_url=url, timeout=60)
    adapter = AdapterClient(
        http, admin_token="adm", model="m", max_tokens=config.max_tokens, temperature=1.0, busy_retries=0
    )
    published = Collected()
    return GymRunner(config, adapter, published), published, http


async def test_python_tool_episode_through_the_adapter_and_a_real_sandbox(tmp_path) -> None:
    script = json.loads((SCRIPTS / "gym" / "python_tool.json").read_text())
    publisher = BusPublisher()
    with engine_process(script, tmp_path) as engine_url:
        app = create_app(settings(engine_url, admin_token="adm", open_sessions=False), publisher)
        async with app.router.lifespan_context(app), served(app) as (url, _):
            runner, published, http = runner_for(url, loss_scope="last_turn")
            async with http:
                solved = await runner.run_task(task("py-solved", {"name": "python_tool", "seed": 2}))
                missed = await runner.run_task(task("py-missed", {"name": "python_tool", "seed": 1}))
            short, _, http = runner_for(url, max_tokens=4)
            async with http:
                cut = await short.run_task(task("py-cut", {"name": "python_tool", "seed": 2}))
    assert (solved.reward, solved.step_rewards, solved.solved) == (1.0, [0.0, 1.0], True)
    assert (missed.reward, missed.failure_kind) == (0.0, None)
    details = json.loads(solved.details)
    assert details["loss_scope"] == "last_turn" and details["turns"] == 2
    tool = details["messages"][3]
    assert tool["role"] == "tool" and tool["content"] == "5525\n"
    infos = json.loads(solved.infos)
    assert infos[1]["exit_codes"] == [0] and infos[2]["given"] == "5525"
    turns = publisher.of("turns", "py-solved")
    assert [(t["chain_id"], t["prompt_ref_turn"]) for t in turns] == [("main", None), ("main", 0)]
    assert [topic for topic, _ in published.records] == ["rewards", "rewards"]
    cut_details = json.loads(cut.details)  # a reply cut by max_tokens ends the episode without a step
    assert (cut_details["stop"], cut_details["turns"], cut.failure_kind, cut.step_rewards) == (
        "length",
        1,
        None,
        [],
    )
    assert [t["finish_reason"] for t in publisher.of("turns", "py-cut")] == ["length"]


async def test_bad_env_config_fails_at_once_without_the_adapter() -> None:
    runner, published, http = runner_for(f"http://127.0.0.1:{free_port()}", attempts=3)
    async with http:
        record = await runner.run_task(task("bad-1", "[1, 2]"))
        other = await runner.run_task(task("bad-2", {"name": "math", "seed": "seven"}))
    assert record.failure_kind == other.failure_kind == "bad_env_config"
    assert "must be a JSON object" in json.loads(record.details)["error"]
    assert "seed must be an integer" in json.loads(other.details)["error"]
    assert json.loads(record.details)["attempts"] == 1 and record.reward == 0.0


async def test_an_unreachable_adapter_is_retried_then_fails_and_each_env_is_closed() -> None:
    runner, _, http = runner_for(f"http://127.0.0.1:{free_port()}", attempts=2)
    async with http:
        record = await runner.run_task(task("down-1", {"name": "counted-test", "tag": "down-1"}))
    assert (
        record.failure_kind == "adapter_error"
        and "opening a session" in json.loads(record.details)["error"]
    )
    assert CLOSES.count("down-1") == 2 and record.attempt_id.startswith("down-1.a2.")
    # the adapter's fault, after its in-process retries: never trained, kept out of its group's mean
    assert (record.failure_class, record.failure_cause) == ("infrastructure", "adapter_error")


def test_reward_record_drops_a_huge_conversation_and_falls_back_to_reward_for_solved() -> None:
    episode = Episode(messages=[{"role": "user", "content": "x" * (MAX_DETAILS_CHARS + 1)}],
                      step_rewards=[0.0, 2.0], infos=[{}, {}, {"note": 1}])  # fmt: skip
    result = EpisodeResult(episode, "r.a1", 1, None, "x")
    record = reward_record(task("r", {"name": "x"}), result, "all_turns")
    details = json.loads(record.details)
    assert details["messages"] is None and details["messages_omitted"] is True
    assert record.solved is True and record.reward == 2.0 and record.group_size == 2
    assert record.failure_class is None and record.failure_cause is None


async def test_a_malformed_task_still_gets_a_reward_naming_the_failure() -> None:
    runner, published, http = runner_for(f"http://127.0.0.1:{free_port()}")
    async with http:
        record = await runner.run_task(task("odd", {"name": "math"}, messages="5"))
        assert record.failure_kind == "bad_env_config"  # messages must be a list: a config error
        record = await runner.run_task(task("odder", {"name": "math"}, messages="[1"))
    assert record.failure_kind == "bad_env_config" and "not valid JSON" in json.loads(record.details)["error"]
    assert [(r.rollout_id, r.group_id, r.group_size) for _, r in published.records] == [
        ("odd", "g", 2), ("odder", "g", 2),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "needle"),
    [("[1]", "not list"), ("{", "not a JSON object"),
     ('{"env_config": [1]}', "env_config must be a JSON object"),
     ('{"env_config": "math"}', "not valid JSON"),
     ('{"env_config": {"name": "m"}, "messages": [1]}', "messages"),
     ('{"env_config": {"name": "m"}, "ctx_config": [1]}', "ctx_config must be a JSON object")],
)  # fmt: skip
def test_gym_submit_refuses_rows_it_cannot_turn_into_tasks(text, needle) -> None:
    with pytest.raises(GymConfigError, match=needle):
        parse_row(text)


def test_gym_submit_keeps_the_ms_swift_row_and_makes_a_group() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    row = parse_row(json.dumps({"messages": messages, "env_config": {"name": "math", "seed": 1},
                                "ctx_config": {"name": "window"}, "answer": 3}))  # fmt: skip
    tasks = tasks_for(row, 3, "data-7", now_ms=5)
    assert [t["sample_index"] for t in tasks] == [0, 1, 2] and len({t["rollout_id"] for t in tasks}) == 3
    assert len({t["group_id"] for t in tasks}) == 1 and tasks[0]["group_size"] == 3
    first = tasks[0]
    assert json.loads(first["env_config"]) == {"name": "math", "seed": 1} and first["prompt"] == "q"
    assert json.loads(first["messages"])[0] == {"role": "system", "content": "s"}
    assert json.loads(first["metadata"]) == {"answer": 3}
    encode("task", first)  # a valid v2 task event


def test_export_writes_a_gym_reward_with_its_tasks_configs_and_skips_a_coding_reward() -> None:
    from rollbus.commands.export import completion_record

    row = task("r", {"name": "math", "seed": 3}, ctx_config="not json")
    asked = [{"role": "user", "content": "q"}]
    episode = Episode(messages=asked, step_rewards=[0.0, 0.5], infos=[{}, {}, {"a": 1}])
    reward = reward_record(row, EpisodeResult(episode, "r.a1", 1, None, "math"), "all_turns")
    line = completion_record(reward, row)
    assert line is not None and line["messages"] == asked
    assert (line["reward"], line["step_rewards"], line["trajectory_infos"][-1]) == (0.5, [0.0, 0.5], {"a": 1})
    assert (line["env_config"], line["ctx_config"]) == ({"name": "math", "seed": 3}, "not json")
    assert (line["group_id"], line["attempt_id"], line["failure_kind"]) == ("g", "r.a1", None)
    gone = completion_record(reward, None)  # the task is no longer on ``tasks``
    assert gone is not None and (gone["env_config"], gone["ctx_config"]) == (None, None)
    coding = RewardEvent(rollout_id="c", reward=1.0, solved=True, applied_cleanly=True, details="{}", at=1)
    assert completion_record(coding, None) is None


def test_replay_tables_show_a_gym_rewards_steps_and_infos() -> None:
    from rollbus.tables import COLUMNS

    episode = Episode(step_rewards=[0.0, 0.5], infos=[{"q": "2+2"}, {"given": "5"}, {"given": "4"}])
    record = reward_record(
        task("r", {"name": "math"}), EpisodeResult(episode, "r.a1", 1, None, "math"), "all_turns"
    )
    cells = {name: cell(record.to_dict()) for name, cell in COLUMNS["reward"]}
    assert cells["step rewards"] == "0,0.5" and cells["infos"].startswith('[{"q": "2+2"}, {"given": "5"}')
