"""Gym environments for multi-turn RL as in ms-swift: ``Env`` (async reset/step/close), ``ContextManager``.

An episode is: create the env from the row's ``env_config``, ``reset``, then loop { the context manager
rewrites the history, one model call, ``step`` with a copy of the conversation, append the observation }
until ``done`` or ``max_turns``. :func:`run_episode` is that loop as a plain async function; the gym runner
service gives it a model call through the adapter, so every turn is token-recorded like the coding agent's.

Where we differ from ms-swift on purpose:

* ``close()`` runs exactly once on every exit path (done, max turns, length stop, model error, env exception,
  timeout, cancellation), not only on ``done`` (ms-swift issue 9745 leaks environments);
* every ``info`` dict (reset first, then one per step) is kept in :class:`Episode` and goes to the bus;
* a context-manager rewrite is not hidden: the adapter's canonical history sees the prompt no longer extends
  the chain's tokens, freezes the chain (a ``wipe`` segment, its ``frozen`` session event naming the
  reason) and starts a new one.

Selection: a row's ``env_config.name`` / ``ctx_config.name`` picks the class from :data:`envs` /
:data:`context_managers` (the constructor gets the whole config dict, name included, as in ms-swift),
falling back to the runner's ``--gym-env`` / ``--context-manager``. ``--external-plugins PATH.py`` imports a
user module (its folder importable) that registers more, with ``envs["x"] = MyEnv`` as in ms-swift or with
:func:`register_env`; loaded after the built-ins, a plugin's name wins over a built-in's.

ms-swift compatibility: an env written for ms-swift runs with its imports changed to
``rollbus.services.gym_runner.gym``. The request is ms-swift's :class:`RolloutInferRequest` (``data_dict`` =
the row's columns other than the request's own, as ms-swift builds it); ``step`` sees each reply as ms-swift's
engine decodes it, the reasoning inside ``content`` as ``<think>...</think>`` (the adapter splits it into
``reasoning_content``);
any class with ``reset`` and ``step`` (async or not) is an env, ``close`` optional.

Extensions over ms-swift's signature, both optional: ``Env.tools`` (OpenAI function tools offered on every
model call) and a ``step`` observation given as a list of chat messages (``tool`` results), not a string.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import inspect
import json
import logging
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

log = logging.getLogger(__name__)

Message = dict[str, Any]
Messages = list[Message]
Observation = str | list[Message]
StopReason = Literal["done", "max_turns", "length", "model_error", "env_error", "timeout", "cancelled"]
# Stops that are the episode's own end; the others are failures (their name is the reward's failure_kind).
CLEAN_STOPS = ("done", "max_turns", "length")
BAD_ENV_CONFIG = "bad_env_config"


class GymConfigError(ValueError):
    """A row's env_config / ctx_config cannot make an env: unknown name, not an object, refused arguments."""

    failure_kind = BAD_ENV_CONFIG


# Columns of a row that are fields of the request itself; every other column goes to ``data_dict``.
REQUEST_FIELDS = ("messages", "images", "audios", "videos", "tools", "objects", "uuid")


@dataclass
class RolloutInferRequest:
    """What ``reset`` gets, with ms-swift's fields: the row's opening messages, its media and tools, and
    ``data_dict`` (the row's other columns, ``env_config`` / ``ctx_config`` among them as objects).
    ``uuid`` is the rollout id (unique per sample, so per-trajectory state keyed by it never collides)."""

    messages: Messages
    images: list[str] = field(default_factory=list)
    audios: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    tools: list[Any] | None = None
    objects: dict[str, Any] = field(default_factory=dict)
    data_dict: dict[str, Any] = field(default_factory=dict)
    uuid: str | None = None

    @property
    def rollout_id(self) -> str:
        return self.uuid or ""


class Env(ABC):
    """One episode's environment; made fresh per attempt from the row's ``env_config``."""

    tools: list[dict[str, Any]] = []  # OpenAI function tools offered to the model (optional extension)

    def __init__(self, env_config: dict[str, Any]) -> None:
        self.env_config = env_config

    @abstractmethod
    async def reset(self, request: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        """``(observation, info, system_message)``: the first user message, its info, the system prompt."""

    @abstractmethod
    async def step(self, messages: list[Message]) -> tuple[Observation, float, bool, dict[str, Any]]:
        """``(next_observation, reward, done, info)``; ``messages``: a copy ending with the model's reply."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the env holds (sandboxes, files); called exactly once per env."""


class ContextManager(ABC):
    """Rewrites the history before every model call (truncation, summaries); the default keeps it."""

    def __init__(self, ctx_config: dict[str, Any]) -> None:
        self.ctx_config = ctx_config

    @abstractmethod
    def manage_context(self, history: list[Message], trajectory_id: str) -> list[Message]: ...


# name -> what makes the env (a class, or any callable taking the env_config): ms-swift's registries.
envs: dict[str, Callable[[dict[str, Any]], Any]] = {}
context_managers: dict[str, Callable[[dict[str, Any]], Any]] = {}
T = TypeVar("T")
ENV_METHODS = ("reset", "step")
CONTEXT_METHODS = ("manage_context",)


def register_env(name: str) -> Callable[[T], T]:
    """Class decorator: ``@register_env("maze")`` makes rows with ``env_config.name == "maze"`` use it
    (the same as ``envs["maze"] = Maze``)."""
    return _registrar(envs, name, ENV_METHODS)


def register_context_manager(name: str) -> Callable[[T], T]:
    return _registrar(context_managers, name, CONTEXT_METHODS)


def _registrar(registry: dict[str, Any], name: str, methods: tuple[str, ...]) -> Callable[[T], T]:
    def register(cls: T) -> T:
        missing = _missing(cls, methods)
        if not isinstance(cls, type) or missing:
            raise TypeError(f"{cls!r} is not a class with {' and '.join(methods)} (missing: {missing})")
        registry[name] = cls
        return cls

    return register


def _missing(obj: Any, methods: tuple[str, ...]) -> list[str]:
    return [m for m in methods if not callable(getattr(obj, m, None))]


def load_plugins(paths: Sequence[str | Path]) -> None:
    """Import each ``PATH.py`` as ms-swift's ``--external_plugins`` does: its folder on ``sys.path`` (so it
    can import the modules beside it), then the file itself, whose registrations win over what was there
    (each replacement is logged). Load the built-ins first. A bad path or a registry entry that cannot
    make anything fails loudly, before any task is taken."""
    for raw in paths:
        path = Path(raw).expanduser().resolve()
        if path.suffix != ".py" or not path.is_file():
            raise GymConfigError(f"--external-plugins: {raw!r} is not a Python file")
        before = {"envs": dict(envs), "context_managers": dict(context_managers)}
        _import_plugin(path)
        for what, registry in (("envs", envs), ("context_managers", context_managers)):
            for name, made_by in registry.items():
                old = before[what].get(name)
                if old is made_by:
                    continue
                if not callable(made_by):
                    raise GymConfigError(f"--external-plugins {raw}: {what}[{name!r}] is not callable")
                if old is None:
                    log.info("plugin %s registers %s[%r] = %s", path, what, name, _qualname(made_by))
                else:
                    log.warning("plugin %s replaces %s[%r]: %s instead of %s", path, what, name,
                                _qualname(made_by), _qualname(old))  # fmt: skip


def _import_plugin(path: Path) -> None:
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = path.stem if path.stem not in sys.modules else f"rollbus_gym_plugin_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


# ---------------------------------------------------------------- selection


def parse_config(raw: str | dict[str, Any] | None, what: str) -> dict[str, Any] | None:
    """A task's env_config / ctx_config (a JSON string on the bus) as a dict; None when absent."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise GymConfigError(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise GymConfigError(f"{what} must be a JSON object, not {type(raw).__name__}")
    return raw


def select(
    config: dict[str, Any] | None,
    registry: dict[str, Callable[[dict[str, Any]], Any]],
    fallback: str | None,
    what: str,
) -> tuple[Callable[[dict[str, Any]], Any], dict[str, Any]] | None:
    """What ``config["name"]`` (else ``fallback``) names, and the config to give it: whole, as ms-swift
    passes it."""
    config = dict(config or {})
    name = config.get("name") or fallback
    if name is None:
        return None
    if not isinstance(name, str):
        raise GymConfigError(f"{what}.name must be a string, not {type(name).__name__}")
    cls = registry.get(name)
    if cls is None:
        known = ", ".join(sorted(registry)) or "none"
        raise GymConfigError(f"{what}.name {name!r} is not registered; registered: {known}")
    return cls, config


def make_env(env_config: dict[str, Any] | None, default: str | None = None) -> Env:
    """The env the row asks for: any object with ``reset`` and ``step`` (it need not subclass Env)."""
    chosen = select(env_config, envs, default, "env_config")
    if chosen is None:
        known = ", ".join(sorted(envs)) or "none"
        raise GymConfigError(f"env_config has no name and no --gym-env default; registered: {known}")
    made_by, config = chosen
    return _construct(made_by, config, "env_config", ENV_METHODS)


def make_context_manager(
    ctx_config: dict[str, Any] | None, default: str | None = None
) -> ContextManager | None:
    chosen = select(ctx_config, context_managers, default, "ctx_config")
    if chosen is None:
        return None
    return _construct(chosen[0], chosen[1], "ctx_config", CONTEXT_METHODS)


def _construct(made_by: Callable[[dict[str, Any]], Any], config: dict[str, Any], what: str,
               methods: tuple[str, ...]) -> Any:  # fmt: skip
    name = getattr(made_by, "__name__", repr(made_by))
    try:
        made = made_by(config)
    except Exception as exc:  # the env's own code refusing the config: its traceback goes to the log
        raise GymConfigError(f"{what} for {name}: {type(exc).__name__}: {exc}") from exc
    missing = _missing(made, methods)
    if missing:
        raise GymConfigError(f"{what}: {name} made {type(made).__name__}, which has no {', '.join(missing)}")
    return made


# ---------------------------------------------------------------- the episode


@dataclass(frozen=True)
class Reply:
    """The model's answer to one call: the assistant message (OpenAI shape) and why it ended."""

    message: Message
    finish_reason: str  # stop | tool_calls | length


class ModelError(RuntimeError):
    """The model call failed (adapter or engine error, network); nothing of that turn was recorded."""


class ContextFull(ModelError):
    """The prompt no longer fits the model's context: the episode ends like a length stop."""


ModelCall = Callable[[list[Message], list[dict[str, Any]]], Awaitable[Reply]]


@dataclass
class Episode:
    """What an episode produced; ``infos`` holds reset's info then one per step."""

    messages: list[Message] = field(default_factory=list)
    step_rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    stop: StopReason = "done"
    error: str | None = None
    turns: int = 0
    closed: int = 0  # times close() ran: 1 once an env existed

    @property
    def reward(self) -> float:
        return float(sum(self.step_rewards))

    @property
    def failure_kind(self) -> str | None:
        return None if self.stop in CLEAN_STOPS else self.stop


async def run_episode(
    env: Env,
    request: RolloutInferRequest,
    model: ModelCall,
    *,
    max_turns: int,
    context_manager: ContextManager | None = None,
    trajectory_id: str = "",
    timeout: float | None = None,
    episode: Episode | None = None,
) -> Episode:
    """Run one episode and close ``env`` exactly once, however it ends; cancellation still propagates.

    Pass ``episode`` to see partial progress if the caller cancels this coroutine.
    """
    episode = episode if episode is not None else Episode()
    try:
        async with asyncio.timeout(timeout):
            await _loop(env, request, model, max_turns, context_manager, trajectory_id, episode)
    except TimeoutError:
        episode.stop, episode.error = "timeout", f"episode took longer than {timeout} s"
    except ContextFull as exc:
        episode.stop, episode.error = "length", str(exc)
    except ModelError as exc:
        episode.stop, episode.error = "model_error", str(exc)
    except asyncio.CancelledError:
        episode.stop, episode.error = "cancelled", "the episode was cancelled"
        raise
    except _EnvFailed as exc:
        episode.stop, episode.error = "env_error", str(exc)
        log.error("%s: %s", trajectory_id or "episode", exc, exc_info=exc.__cause__ or exc)
    finally:
        await close_env(env, episode)
    return episode


class _EnvFailed(Exception):
    """The env's own code raised (reset, step, or the context manager)."""


async def _loop(
    env: Env,
    request: RolloutInferRequest,
    model: ModelCall,
    max_turns: int,
    context_manager: ContextManager | None,
    trajectory_id: str,
    episode: Episode,
) -> None:
    observation, info, system = _reset_result(await _env_call(env.reset, request, what="reset"))
    episode.infos.append(_plain(info))
    episode.messages = _opening(system, observation, request.messages)
    while True:
        if context_manager is not None:
            episode.messages = _managed(context_manager, episode.messages, trajectory_id)
        reply = await model(copy.deepcopy(episode.messages), list(getattr(env, "tools", None) or []))
        episode.turns += 1
        episode.messages.append(dict(reply.message))
        if reply.finish_reason == "length":
            episode.stop = "length"
            return
        result = await _env_call(env.step, as_decoded(episode.messages), what="step")
        step_observation, reward, done, info = _step_result(result)
        episode.step_rewards.append(reward)
        episode.infos.append(_plain(info))
        if done:
            episode.stop = "done"
            return
        if episode.turns >= max_turns:
            episode.stop = "max_turns"
            return
        episode.messages.extend(_observation_messages(step_observation))


async def _env_call(method: Callable[..., Any], *args: Any, what: str) -> Any:
    """``method(*args)``, awaited when it is a coroutine (ms-swift envs are async; a sync one works too)."""
    try:
        result = method(*args)
        return await result if inspect.isawaitable(result) else result
    except Exception as exc:  # CancelledError (a BaseException) passes through
        raise _EnvFailed(f"env {what} raised {type(exc).__name__}: {exc}") from exc


def as_decoded(messages: list[Message]) -> list[Message]:
    """A copy of ``messages`` as ms-swift hands them to ``step``: each reply's reasoning back inside its
    ``content``, written as the chat template renders it (``<think>\\nR\\n</think>\\n\\n`` + text)."""
    decoded = copy.deepcopy(messages)
    for message in decoded:
        reasoning = message.get("reasoning_content") if message.get("role") == "assistant" else None
        if isinstance(reasoning, str) and reasoning:
            del message["reasoning_content"]
            message["content"] = f"<think>\n{reasoning}\n</think>\n\n{message.get('content') or ''}"
    return decoded


def _reset_result(result: Any) -> tuple[str, Any, str]:
    try:
        observation, info, system = result
    except (TypeError, ValueError):
        raise _EnvFailed(
            f"env reset must return (observation, info, system_message), not {result!r:.200}"
        ) from None
    if not isinstance(observation, str) or not isinstance(system, str | None):
        raise _EnvFailed("env reset: observation and system_message must be strings")
    return observation, info, system or ""


def _step_result(result: Any) -> tuple[Observation, float, bool, Any]:
    """A step's 4-tuple checked: a reward that is not a finite number would poison the trajectory's sum."""
    try:
        observation, reward, done, info = result
        reward = float(reward)
    except (TypeError, ValueError):
        raise _EnvFailed(
            f"env step must return (observation, reward, done, info), not {result!r:.200}"
        ) from None
    if not math.isfinite(reward):
        raise _EnvFailed(f"env step returned a reward that is not finite: {reward}")
    if not isinstance(observation, str | list):
        raise _EnvFailed("env step: the observation must be a string or a list of messages")
    return observation, reward, bool(done), info


def _managed(manager: ContextManager, messages: list[Message], trajectory_id: str) -> list[Message]:
    try:
        managed = manager.manage_context(copy.deepcopy(messages), trajectory_id)
    except Exception as exc:
        raise _EnvFailed(f"context manager raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(managed, list) or not all(isinstance(m, dict) for m in managed):
        raise _EnvFailed("context manager must return a list of message dicts")
    return managed


def _opening(system: str, observation: str, row_messages: list[Message]) -> list[Message]:
    """System message (if any), then the reset observation as the user turn, else the row's own messages."""
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    if observation:
        messages.append({"role": "user", "content": observation})
    else:
        messages.extend(copy.deepcopy(m) for m in row_messages if not (system and m.get("role") == "system"))
    return messages


def _observation_messages(observation: Observation) -> list[Message]:
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    return [dict(m) for m in observation]


def _plain(info: Any) -> dict[str, Any]:
    """An info dict as JSON will carry it (unknown values become strings), so the bus can hold it."""
    if not isinstance(info, dict):
        info = {"info": info}
    return json.loads(json.dumps(info, default=str))


async def close_env(env: Env, episode: Episode) -> None:
    """``env.close()`` unless ``episode`` says it ran (an env without ``close`` has nothing to close; a sync
    one is called): to completion even if the caller is being cancelled; its errors are logged with their
    traceback and kept in the infos, never raised."""
    if episode.closed:
        return
    episode.closed += 1
    try:
        close = getattr(env, "close", None)
        result = close() if callable(close) else None
        if not inspect.isawaitable(result):
            return
        closing = asyncio.ensure_future(result)
        try:
            await asyncio.shield(closing)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await closing
            raise
    except Exception as exc:
        log.error("env close failed: %s: %s", type(exc).__name__, exc, exc_info=exc)
        episode.infos.append({"close_error": f"{type(exc).__name__}: {exc}"})
