"""rollbus.services.gym_runner.gym: selection and fallbacks, plugins, bad configs, and close() exactly once
on every exit path.

The model is a plain async function here (the driver's only collaborator); the adapter path is exercised
end to end in tests/test_gym_e2e.py.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

import rollbus.services.gym_runner.envs  # noqa: F401  (registers the built-ins)
from rollbus.services.gym_runner import gym
from rollbus.services.gym_runner.gym import (
    ContextFull,
    ContextManager,
    Env,
    GymConfigError,
    ModelError,
    Reply,
    RolloutInferRequest,
    make_context_manager,
    make_env,
    parse_config,
    run_episode,
)


@pytest.fixture(autouse=True)
def registries():
    """What a test registers (plugins) is gone after it, so other modules see only their own."""
    envs, managers = dict(gym.envs), dict(gym.context_managers)
    yield
    gym.envs.clear(), gym.envs.update(envs)
    gym.context_managers.clear(), gym.context_managers.update(managers)


class Scripted(Env):
    """Done after ``done_after`` steps; ``fail`` in {"reset", "step", "close"} raises there."""

    def __init__(self, env_config):
        super().__init__(env_config)
        self.closes = 0
        self.steps = 0

    async def reset(self, request):
        if self.env_config.get("fail") == "reset":
            raise RuntimeError("reset broke")
        return "start", {"phase": "reset", "odd": {1, 2}}, "be brief"

    async def step(self, messages):
        if self.env_config.get("fail") == "step":
            raise ValueError("step broke")
        self.steps += 1
        done = self.steps >= self.env_config.get("done_after", 99)
        return f"obs {self.steps}", 0.25 * self.steps, done, {"step": self.steps}

    async def close(self):
        self.closes += 1
        if self.env_config.get("fail") == "close":
            raise OSError("close broke")


gym.register_env("scripted-test")(Scripted)


def answer(finish="stop", text="ok"):
    async def model(messages, tools):
        return Reply({"role": "assistant", "content": text}, finish)

    return model


async def episode(config, model, **kw):
    env = Scripted(config)
    result = await run_episode(env, RolloutInferRequest([{"role": "user", "content": "row"}]), model,
                               max_turns=kw.pop("max_turns", 5), **kw)  # fmt: skip
    return env, result


# ---------------------------------------------------------------- selection


def test_selection_by_name_fallback_and_constructor_arguments() -> None:
    env = make_env({"name": "frozen_lake", "map": ["SG"]}, default="math")
    assert type(env).__name__ == "FrozenLakeEnv"  # the config whole, name included, as ms-swift passes it
    assert env.env_config == {"name": "frozen_lake", "map": ["SG"]}
    assert type(make_env({"seed": 3}, default="math")).__name__ == "MathEnv"  # no name: the fallback
    assert type(make_env(None, default="math")).__name__ == "MathEnv"
    assert make_context_manager(None) is None
    assert make_context_manager({"name": "window", "keep": 2}).keep == 2
    assert make_context_manager({}, default="window").keep == 6


@pytest.mark.parametrize(
    ("env_config", "default", "needle"),
    [
        ({"name": "nope"}, None, "'nope' is not registered; registered: "),
        ({}, None, "no name and no --gym-env default"),
        ({"name": 7}, None, "env_config.name must be a string"),
        ({"name": "math", "seed": "x"}, None, "seed must be an integer"),
        ({"name": "math", "question": "?", "answer": "__import__('os')"}, None, "is not a number"),
        ({"name": "frozen_lake", "map": ["SXG"]}, None, "only S, F, H, G"),
        ({"name": "frozen_lake", "size": 99}, None, "size must be 2..12"),
    ],
)
def test_bad_env_config_is_a_clear_error_with_a_failure_kind(env_config, default, needle) -> None:
    with pytest.raises(GymConfigError, match=None) as caught:
        make_env(env_config, default)
    assert needle in str(caught.value)
    assert caught.value.failure_kind == "bad_env_config"
    if "registered: " in needle:  # every registered name, sorted (test modules add their own)
        listed = str(caught.value).split("registered: ")[1].split(", ")
        assert {"frozen_lake", "math", "python_tool"} <= set(listed) and listed == sorted(listed)


@pytest.mark.parametrize(
    ("raw", "needle"), [("{", "not valid JSON"), ("[1]", "must be a JSON object"), ('"math"', "JSON object")]
)
def test_env_config_on_the_bus_must_be_a_json_object(raw, needle) -> None:
    with pytest.raises(GymConfigError, match=needle):
        parse_config(raw, "env_config")
    assert parse_config(None, "env_config") is None and parse_config('{"name": "m"}', "x") == {"name": "m"}


def test_unknown_context_manager_lists_the_registered_ones() -> None:
    with pytest.raises(GymConfigError, match="registered: dummyContextManager, window"):
        make_context_manager({"name": "summary"})
    with pytest.raises(GymConfigError, match="keep must be at least 1"):
        make_context_manager({"name": "window", "keep": 0})


def test_plugins_register_their_envs(tmp_path) -> None:
    plugin = tmp_path / "my_envs.py"
    plugin.write_text(textwrap.dedent('''
        from rollbus.services.gym_runner.gym import Env, register_env

        @register_env("coin")
        class Coin(Env):
            async def reset(self, request):
                return "heads or tails?", {}, ""
            async def step(self, messages):
                return "", 1.0, True, {}
    '''))  # fmt: skip
    gym.load_plugins([str(plugin)])
    assert type(make_env({"name": "coin"})).__name__ == "Coin"
    with pytest.raises(GymConfigError, match="not a Python file"):
        gym.load_plugins([str(tmp_path / "missing.py")])
    with pytest.raises(TypeError, match=r"missing: \['reset', 'step'\]"):
        gym.register_env("bad")(dict)


async def test_a_plain_class_with_sync_methods_and_no_close_is_an_env() -> None:
    class Plain:
        def __init__(self, env_config):
            self.steps = 0

        def reset(self, request):
            return "count", {"sync": True}, ""

        def step(self, messages):
            self.steps += 1
            return "more", 1.0, self.steps == 2, {}

    gym.envs["plain-test"] = Plain
    env = make_env({"name": "plain-test"})
    result = await run_episode(env, RolloutInferRequest([]), answer(), max_turns=5)
    assert (result.stop, result.step_rewards, result.infos[0], result.closed) == (
        "done",
        [1.0, 1.0],
        {"sync": True},
        1,
    )
    gym.envs["no-step-test"] = lambda config: object()
    with pytest.raises(GymConfigError, match="made object, which has no reset, step"):
        make_env({"name": "no-step-test"})


# ---------------------------------------------------------------- close() on every path


async def test_done_keeps_every_info_and_sums_step_rewards() -> None:
    env, result = await episode({"done_after": 2}, answer())
    assert (result.stop, result.failure_kind, env.closes, result.closed) == ("done", None, 1, 1)
    assert result.step_rewards == [0.25, 0.5] and result.reward == 0.75
    assert result.infos == [{"phase": "reset", "odd": "{1, 2}"}, {"step": 1}, {"step": 2}]
    roles = [m["role"] for m in result.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert result.messages[3]["content"] == "obs 1"


async def test_max_turns() -> None:
    env, result = await episode({}, answer(), max_turns=3)
    assert (result.stop, result.turns, env.closes, len(result.infos)) == ("max_turns", 3, 1, 4)


async def test_length_stop_ends_without_a_step() -> None:
    env, result = await episode({}, answer(finish="length"))
    assert (result.stop, result.failure_kind, env.steps, env.closes) == ("length", None, 0, 1)


async def test_context_full_is_a_length_stop() -> None:
    async def full(messages, tools):
        raise ContextFull("prompt is too long: 5000 tokens > 4096 maximum")

    env, result = await episode({}, full)
    assert (result.stop, env.closes) == ("length", 1)


async def test_model_error() -> None:
    async def broken(messages, tools):
        raise ModelError("500 engine down")

    env, result = await episode({}, broken)
    assert (result.failure_kind, result.error, env.closes) == ("model_error", "500 engine down", 1)


@pytest.mark.parametrize("where", ["reset", "step"])
async def test_env_exception(where) -> None:
    env, result = await episode({"fail": where}, answer())
    assert result.failure_kind == "env_error" and where in result.error and env.closes == 1


async def test_close_raising_is_recorded_not_raised() -> None:
    env, result = await episode({"fail": "close", "done_after": 1}, answer())
    assert env.closes == 1 and result.stop == "done"
    assert result.infos[-1] == {"close_error": "OSError: close broke"}


async def test_timeout() -> None:
    async def hangs(messages, tools):
        await asyncio.Event().wait()

    env, result = await episode({}, hangs, timeout=0.05)
    assert (result.failure_kind, env.closes) == ("timeout", 1)


async def test_cancellation_closes_then_propagates() -> None:
    called = asyncio.Event()

    async def hangs(messages, tools):
        called.set()
        await asyncio.Event().wait()

    env = Scripted({})
    partial = gym.Episode()
    task = asyncio.create_task(run_episode(env, RolloutInferRequest([]), hangs, max_turns=3, episode=partial))
    await called.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (env.closes, partial.stop, partial.closed) == (1, "cancelled", 1)


async def test_cancelled_during_close_still_finishes_close() -> None:
    closing, release = asyncio.Event(), asyncio.Event()

    class SlowClose(Scripted):
        async def close(self):
            closing.set()
            await release.wait()
            self.closes += 1

    env = SlowClose({"done_after": 1})
    task = asyncio.create_task(run_episode(env, RolloutInferRequest([]), answer(), max_turns=3))
    await closing.wait()
    task.cancel()
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert env.closes == 1


# ---------------------------------------------------------------- context managers


class DropMiddle(ContextManager):
    def manage_context(self, history, trajectory_id):
        assert trajectory_id == "r-1"
        return history[:2] + history[-1:] if len(history) > 4 else history


async def test_context_manager_rewrites_what_the_model_sees() -> None:
    seen: list[list[dict]] = []

    async def model(messages, tools):
        seen.append(messages)
        return Reply({"role": "assistant", "content": "x"}, "stop")

    env = Scripted({"done_after": 3})
    await run_episode(env, RolloutInferRequest([]), model, max_turns=5, context_manager=DropMiddle({}),
                      trajectory_id="r-1")  # fmt: skip
    # [sys, user]; [sys, user, a, obs 1]; then [sys, user, a, obs 1, a, obs 2] cut to [sys, user, obs 2]
    assert [len(m) for m in seen] == [2, 4, 3] and seen[2][-1]["content"] == "obs 2"


async def test_context_manager_returning_garbage_is_an_env_error() -> None:
    class Garbage(ContextManager):
        def manage_context(self, history, trajectory_id):
            return "not a list"

    env = Scripted({})
    result = await run_episode(
        env, RolloutInferRequest([]), answer(), max_turns=2, context_manager=Garbage({})
    )
    assert result.failure_kind == "env_error" and "list of message dicts" in result.error and env.closes == 1


def test_window_keeps_the_opening_and_starts_at_a_user_turn() -> None:
    manager = make_context_manager({"name": "window", "keep": 3})
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    for i in range(4):
        history += [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"o{i}"}]
    kept = manager.manage_context(history, "r")
    assert [m["content"] for m in kept] == ["s", "q", "o2", "a3", "o3"]
    assert manager.manage_context(history[:4], "r") == history[:4]


async def test_the_docs_example_registers_and_plays(tmp_path) -> None:
    """docs/gym.md's environment, as a plugin file, is under 30 lines and works."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "gym.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) < 30
    plugin = tmp_path / "my_envs.py"
    plugin.write_text(code)
    gym.load_plugins([plugin])
    guesses = iter(["<guess>2</guess>", "<guess>4</guess>"])

    async def model(messages, tools):
        return Reply({"role": "assistant", "content": next(guesses)}, "stop")

    result = await run_episode(
        make_env({"name": "guess", "secret": 4}), RolloutInferRequest([]), model, max_turns=5
    )
    assert result.step_rewards == [0.0, 1.0] and result.messages[3]["content"] == "No, higher."


@pytest.mark.parametrize(
    ("reset", "step", "needle"),
    [(("obs", {}), None, "must return (observation, info, system_message)"),
     ((1, {}, ""), None, "must be strings"),
     (None, ("o", float("nan"), False, {}), "not finite"),
     (None, ("o", "lots", False, {}), "must return (observation, reward, done, info)"),
     (None, ("o", 1.0), "must return (observation, reward, done, info)"),
     (None, (None, 1.0, False, {}), "string or a list of messages")],
)  # fmt: skip
async def test_an_env_returning_the_wrong_shape_is_an_env_error(reset, step, needle) -> None:
    class Wrong(Scripted):
        async def reset(self, request):
            return reset if reset is not None else await super().reset(request)

        async def step(self, messages):
            return step

    env = Wrong({})
    result = await run_episode(env, RolloutInferRequest([]), answer(), max_turns=3)
    assert result.failure_kind == "env_error" and needle in result.error and env.closes == 1
    assert result.step_rewards == []
