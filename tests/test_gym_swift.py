"""Environments written for ms-swift run with only their imports changed to
``rollbus.services.gym_runner.gym``.

The plugin below is written the ms-swift way (our own code, in its style): it registers into ``envs`` and
``context_managers`` by assignment, imports a module beside it, reads the row's columns from
``request.data_dict``, registers ``frozen_lake`` (a built-in's name) and ``math_env`` (ms-swift's built-in's
name, the ``--gym-env`` of rows without ``env_config``), and one env does not subclass rollbus's ``Env``.
Its rows go through the real ``rollbus gym-submit``; the runner is the real ``rollbus gym-runner`` process,
started with the argv ``rollbus up --external-plugins ... --gym-env ...`` gives it; the adapter, the
scripted engine (examples/scripts/gym/math_lake.json) and Kafka are real. Each env reports what it was
given in its infos, so the assertions read it back from the ``rewards`` topic.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import rollbus.services.stack.demo
import rollbus.services.stack.up
from rollbus.cli import command_parser
from rollbus.events import TaskEvent
from rollbus.services.gym_runner.gym import RolloutInferRequest, as_decoded
from rollbus.services.gym_runner.runner import request_for
from rollbus.services.stack.demo import DemoSettings
from rollbus.services.stack.supervisor import ServiceSpec
from rollbus.services.stack.up import Stack, StackSettings, service_specs
from rollbus.settings import SettingsError
from tests.test_gym_e2e import (
    SCRIPT,  # noqa: F401  (the conftest engine_url replays it)
    events,
    rewards_for,
    stack,
)

BOARD = """
import re

MOVE = re.compile(r"<move>(\\w+)</move>")


def read_move(text):
    found = MOVE.findall(text or "")
    return found[-1] if found else None
"""

PLUGIN = '''
import re

from rollbus.services.gym_runner.gym import (
    ContextManager, Env, Messages, RolloutInferRequest, context_managers, envs,
)

from lake_board import read_move  # the module beside this file, as ms-swift's plugins do


class FrozenLakeEnv(Env):
    async def reset(self, config: RolloutInferRequest):
        seen = {"plugin": "swift_envs", "uuid": config.uuid, "env_config": self.env_config,
                "images": config.images, "tools": config.tools, "data_dict": config.data_dict}
        return "You stand on the ice. Which way?", seen, "Answer with <move>DIRECTION</move>."

    async def step(self, action: Messages):
        reply = action[-1]
        move = read_move(reply["content"])
        info = {"move": move, "reply": reply["content"], "keys": sorted(reply)}
        return "Splash.", 1.0 if move == "down" else 0.0, True, info

    async def close(self):
        pass


class MathEnv(Env):
    async def reset(self, config: RolloutInferRequest):
        self.solution = config.data_dict["solution"]
        return config.data_dict["problem"], {"data_dict": config.data_dict}, "Answer in <answer></answer>."

    async def step(self, action: Messages):
        found = re.findall(r"<answer>(.*?)</answer>", action[-1]["content"])
        right = bool(found) and found[-1].strip() == self.solution
        return "Check again.", 1.0 if right else 0.0, right, {"given": found[-1] if found else None}

    async def close(self):
        pass


class Tally:
    """Not a subclass of rollbus's Env: anything with reset and step is an env; its close is not async."""

    def __init__(self, env_config):
        self.env_config, self.turns = env_config, 0

    async def reset(self, config):
        return "Count with me.", {"class": type(self).__mro__[1].__name__}, ""

    async def step(self, action):
        self.turns += 1
        return "More.", 0.5, self.turns >= 2, {"turn": self.turns}

    def close(self):
        with open(self.env_config["closed_to"], "a") as out:
            out.write("closed\\n")


class Broken(Env):
    async def reset(self, config):
        return "Go.", {}, ""

    async def step(self, action):
        return {}["reward_table"]

    async def close(self):
        pass


class KeepAll(ContextManager):
    def manage_context(self, history, trajectory_id):
        return history


envs["frozen_lake"] = FrozenLakeEnv
envs["math_env"] = MathEnv
envs["tally"] = Tally
envs["broken"] = Broken
context_managers["keep_all"] = KeepAll
'''

TOOL = {"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}
FIRST_REPLY = "Seven sevens are 49, minus 25 is 24; on the lake, down first."  # the script's first reasoning


def write_plugin(folder: Path) -> Path:
    folder.mkdir()
    (folder / "lake_board.py").write_text(textwrap.dedent(BOARD))
    plugin = folder / "swift_envs.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    return plugin


def up_settings(*argv: str, command: str = "up") -> StackSettings:
    module = rollbus.services.stack.up if command == "up" else rollbus.services.stack.demo
    settings = DemoSettings if command == "demo" else StackSettings
    return settings.from_args(command_parser(command, module).parse_args(list(argv)))


def gym_runner(settings: StackSettings, stack_at: Stack) -> ServiceSpec:
    (spec,) = [s for s in service_specs(settings, stack_at) if s.name == "gym-runner"]
    return spec


def gym_runner_argv(settings: StackSettings, stack_at: Stack) -> list[str]:
    return list(gym_runner(settings, stack_at).argv)


@pytest.mark.kafka
async def test_ms_swift_style_envs_run_through_the_runner_that_rollbus_up_starts(
    kafka_bootstrap, topics, engine_url, tmp_path
):
    namespace = topics["tasks"].rsplit(".", 1)[0]
    plugin = write_plugin(tmp_path / "plugins")
    closed_to = tmp_path / "tally-closed.txt"
    rows = {
        "lake": {"messages": [{"role": "user", "content": "play"}],
                 "env_config": {"name": "frozen_lake", "size": 4},
                 "images": ["lake.png"], "tools": json.dumps([TOOL]), "level": 3},
        "math": {"messages": [{"role": "user", "content": "What is 7 * 7 - 25?"}],
                 "problem": "What is 7 * 7 - 25?", "solution": "24"},  # no env_config: --gym-env
        "tally": {"env_config": {"name": "tally", "closed_to": str(closed_to)},
                  "ctx_config": {"name": "keep_all"}},
        "broken": {"env_config": {"name": "broken"}},
        "noproblem": {"messages": [{"role": "user", "content": "hi"}], "env_config": {"name": "math_env"}},
    }  # fmt: skip
    dataset = tmp_path / "swift.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows.values()))
    common = ["--bootstrap-servers", kafka_bootstrap, "--namespace", namespace]
    submitted = subprocess.run([sys.executable, "-m", "rollbus", "gym-submit", str(dataset), *common],
                               capture_output=True, text=True, timeout=120)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    tasks = await events(kafka_bootstrap, topics["tasks"])
    ids = {name: f"swift-{line}-" for line, name in enumerate(rows, start=1)}
    ids = {
        name: next(t["rollout_id"] for t in tasks if t["group_id"].startswith(p)) for name, p in ids.items()
    }

    settings = up_settings("--external-plugins", str(plugin), "--gym-env", "math_env",
                           "--state-dir", str(tmp_path / "state"))  # fmt: skip
    log_path = tmp_path / "gym-runner.log"
    async with stack(kafka_bootstrap, namespace, engine_url, in_process=False) as (_, _publisher, url):
        at = Stack(kafka_bootstrap, namespace, url, engine_url, "adm", tmp_path / "logs", "key")
        spec = gym_runner(settings, at)  # the runner as `rollbus up` starts it, token in its environment
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                spec.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **spec.env}
            )
            try:
                rewards = await rewards_for(kafka_bootstrap, topics["rewards"], set(ids.values()))
            finally:
                proc.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(proc.wait, 60)
    log_text = log_path.read_text()
    assert code == 0 and set(rewards) == set(ids.values()), log_text
    got = {name: rewards[rollout] for name, rollout in ids.items()}
    infos = {name: json.loads(record["infos"]) for name, record in got.items()}

    # the plugin's frozen_lake ran, not the built-in, and the log says it replaced it
    assert (got["lake"]["reward"], got["lake"]["failure_kind"]) == (1.0, None), got["lake"]["details"]
    seen = infos["lake"][0]
    assert seen["plugin"] == "swift_envs" and seen["uuid"] == ids["lake"]
    assert seen["env_config"] == {"name": "frozen_lake", "size": 4}  # whole, as ms-swift passes it
    assert (seen["images"], seen["tools"]) == (["lake.png"], [TOOL])
    assert seen["data_dict"] == {"env_config": {"name": "frozen_lake", "size": 4}, "level": 3}
    replaced = "replaces envs['frozen_lake']: swift_envs.FrozenLakeEnv instead of rollbus.services.gym_runner"
    assert replaced in log_text
    # step sees the reply as ms-swift decodes it: the reasoning inside content, no reasoning_content
    step = infos["lake"][1]
    assert step["reply"] == f"<think>\n{FIRST_REPLY}\n</think>\n\n<move>down</move> <answer>24</answer>"
    assert step["keys"] == ["content", "role"]

    # a row without env_config ran --gym-env's env, which read the row's columns from data_dict
    assert (got["math"]["reward"], got["math"]["step_rewards"], got["math"]["failure_kind"]) == (
        1.0,
        [1.0],
        None,
    )
    assert infos["math"][0]["data_dict"] == {"problem": "What is 7 * 7 - 25?", "solution": "24"}

    # a class that is not rollbus's Env plays, its sync close called once
    assert (got["tally"]["reward"], got["tally"]["step_rewards"], got["tally"]["failure_kind"]) == (
        1.0, [0.5, 0.5], None)  # fmt: skip
    assert infos["tally"][0] == {"class": "object"} and closed_to.read_text() == "closed\n"

    # env errors: on the bus, and in the runner's log with the env's own traceback
    for name, error in (("broken", "KeyError: 'reward_table'"), ("noproblem", "KeyError: 'solution'")):
        assert got[name]["failure_kind"] == "env_error" and error in json.loads(got[name]["details"])["error"]
        entry = log_text.split(f"{ids[name]}: env ", 1)[1].split(" rollbus.", 1)[0]
        assert "Traceback (most recent call last)" in entry and str(plugin) in entry and error in entry, entry


def test_up_and_demo_give_the_gym_runner_their_plugin_flags(tmp_path, monkeypatch) -> None:
    plugin = write_plugin(tmp_path / "plugins")
    monkeypatch.chdir(plugin.parent)
    at = Stack("b:9092", "ns", "http://127.0.0.1:1", "http://127.0.0.1:2", "adm", tmp_path / "logs", "key")
    up = gym_runner_argv(up_settings("--external-plugins", plugin.name, "--gym-env", "math_env"), at)
    assert up[-4:] == ["--external-plugins", str(plugin), "--gym-env", "math_env"]  # made absolute
    demo = up_settings("--gym", "--external-plugins", plugin.name, "--gym-env", "math_env", command="demo")
    assert gym_runner_argv(demo, at)[-4:] == up[-4:]
    assert "--external-plugins" not in gym_runner_argv(up_settings(), at)
    with pytest.raises(SettingsError, match="go to the gym runner: add --gym"):
        up_settings(
            "--external-plugins", plugin.name, command="demo"
        )  # the demo runs no gym runner by default
    with pytest.raises(SettingsError, match="'.*missing.py' is not a Python file"):
        up_settings("--external-plugins", "missing.py")


async def test_an_env_constructor_raising_is_a_config_error_logged_with_its_traceback(caplog) -> None:
    from rollbus.kafka.broker import free_port
    from rollbus.services.gym_runner import gym
    from tests.test_gym_runner import runner_for

    def needs_a_board(env_config):
        return env_config["board"]

    gym.envs["needs-board-test"] = needs_a_board  # any callable taking env_config makes envs, as in ms-swift
    try:
        runner, _, http = runner_for(f"http://127.0.0.1:{free_port()}")
        async with http:
            with caplog.at_level("ERROR"):
                record = await runner.run_task(
                    task(rollout_id="nb-1", env_config='{"name": "needs-board-test"}', messages=None)
                )
    finally:
        del gym.envs["needs-board-test"]
    error = json.loads(record.details)["error"]
    assert record.failure_kind == "bad_env_config" and "needs_a_board: KeyError: 'board'" in error
    (logged,) = [r for r in caplog.records if "nb-1" in r.getMessage()]
    assert logged.exc_info is not None and logged.exc_info[1].args == ("board",)


def test_the_runner_refuses_to_start_on_a_default_env_nobody_registered(tmp_path) -> None:
    plugin = write_plugin(tmp_path / "plugins")
    ran = subprocess.run(
        [sys.executable, "-m", "rollbus", "gym-runner", "--admin-token", "adm", "--bootstrap-servers",
         "127.0.0.1:1", "--external-plugins", str(plugin), "--gym-env", "chess"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ran.returncode == 2 and "--gym-env: 'chess' is not registered; registered: " in ran.stderr
    assert "math_env" in ran.stderr.split("registered: ")[1]  # the plugin's names count


# ---------------------------------------------------------------- the request and the step's view


def task(**fields: Any) -> TaskEvent:
    messages = json.dumps([{"role": "user", "content": "q"}])
    row = {"rollout_id": "r-1", "group_id": "g", "sample_index": 0, "group_size": 1, "prompt": "",
           "metadata": "{}", "submitted_at": 0, "messages": messages, **fields}  # fmt: skip
    return TaskEvent(**row)


@pytest.mark.parametrize(
    ("metadata", "env_config", "ctx_config", "data_dict", "request_fields"),
    [
        ({}, None, None, {}, {}),
        ({"problem": "p", "solution": "s", "note": None}, {}, None, {"problem": "p", "solution": "s"}, {}),
        ({"a": 1}, {"name": "x", "k": 2}, {"name": "w"},
         {"a": 1, "env_config": {"name": "x", "k": 2}, "ctx_config": {"name": "w"}}, {}),
        ({"images": "one.png", "videos": ["v"], "audios": [], "objects": {"ref": [1]}, "tools": "[1, 2]"},
         None, None, {}, {"images": ["one.png"], "videos": ["v"], "audios": [], "objects": {"ref": [1]},
                          "tools": [1, 2]}),
        ({"tools": "not json"}, None, None, {}, {"tools": "not json"}),
        ({"uuid": "row-uuid", "x": 1, "data_dict": {"x": 2, "y": 3}}, None, None,
         {"uuid": "row-uuid", "x": 2, "y": 3}, {}),
    ],
)  # fmt: skip
def test_the_request_is_the_row_as_ms_swift_builds_it(
    metadata, env_config, ctx_config, data_dict, request_fields
):
    request = request_for(task(metadata=json.dumps(metadata)), env_config, ctx_config)
    expected = RolloutInferRequest([{"role": "user", "content": "q"}], data_dict=data_dict, uuid="r-1",
                                   **request_fields)  # fmt: skip
    assert request == expected and request.rollout_id == "r-1"


def test_the_rows_response_is_not_part_of_the_prompt() -> None:
    """ms-swift drops a row's trailing assistant message (the dataset's answer) from the request."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "the answer"}]
    request = request_for(task(messages=json.dumps(messages), metadata="{}"), None, None)
    assert request.messages == messages[:1]


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [("[1]", "metadata must be a JSON object"), ("{", "metadata is not valid JSON"),
     ('{"data_dict": [1]}', "data_dict must be a JSON object")],
)  # fmt: skip
def test_a_row_that_cannot_make_a_request_is_a_config_error(metadata, needle) -> None:
    from rollbus.services.gym_runner.gym import GymConfigError

    with pytest.raises(GymConfigError, match=needle):
        request_for(task(metadata=metadata), None, None)


def test_step_sees_each_reply_with_its_reasoning_inside_content() -> None:
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q", "reasoning_content": "not a reply's"},
        {"role": "assistant", "content": "A", "reasoning_content": "R1"},
        {"role": "assistant", "content": None, "reasoning_content": "R2", "tool_calls": [{"id": "c"}]},
        {"role": "assistant", "content": "plain"},
        {"role": "assistant", "content": "empty", "reasoning_content": ""},
    ]
    before = json.loads(json.dumps(messages))
    decoded = as_decoded(messages)
    assert messages == before  # a copy: the conversation the model sees keeps reasoning_content
    assert decoded[:2] == before[:2] and decoded[4:] == before[4:]
    assert decoded[2] == {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA"}
    assert decoded[3] == {
        "role": "assistant",
        "content": "<think>\nR2\n</think>\n\n",
        "tool_calls": [{"id": "c"}],
    }


def test_a_plugin_folder_is_importable_and_its_registrations_win(tmp_path, caplog) -> None:
    import rollbus.services.gym_runner.envs  # noqa: F401  (registers the built-ins)
    from rollbus.services.gym_runner import gym

    saved = dict(gym.envs), dict(gym.context_managers)
    plugin = write_plugin(tmp_path / "plugins")
    try:
        with caplog.at_level("INFO", logger="rollbus.services.gym_runner.gym"):
            gym.load_plugins([plugin])
        assert type(gym.make_env({"name": "frozen_lake"})).__module__ == "swift_envs"
        assert type(gym.make_env({}, default="tally")).__name__ == "Tally"
        assert type(gym.make_context_manager({"name": "keep_all"})).__name__ == "KeepAll"
        lines = [r.getMessage() for r in caplog.records]
        assert any("replaces envs['frozen_lake']" in line for line in lines)
        assert any("registers envs['tally'] = swift_envs.Tally" in line for line in lines)
    finally:
        for registry, old in zip((gym.envs, gym.context_managers), saved, strict=True):
            registry.clear(), registry.update(old)
