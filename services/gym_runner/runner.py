"""One gym task -> attempts -> one ``reward`` record (and the turns the adapter recorded on the way).

Per attempt: make the env from the row (a bad ``env_config`` fails the task at once as ``bad_env_config``,
never retried), open an adapter session, run the episode (:func:`rollbus.services.gym_runner.gym.run_episode`
closes the env on every path), close the session (also on every path). ``model_error`` and ``timeout`` are
retried with a new attempt id while attempts remain; the other ends are final. The reward record says how it
ended:

* ``reward`` = sum of ``step_rewards`` (ms-swift's trajectory reward), ``infos`` = reset's info then each
  step's, ``failure_kind`` = None for done / max_turns / length, else ``bad_env_config``, ``adapter_error``,
  ``model_error``, ``env_error``, ``timeout`` or ``runner_error``;
* ``details``: ``{"kind": "gym", "env", "stop", "error", "turns", "attempts", "loss_scope", "messages"}``;
  ``loss_scope`` (``all_turns`` | ``last_turn``) is how the segmenter/trainer learns which turns to train.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rollbus.events import RewardEvent, TaskEvent
from rollbus.events.reward import reward_event
from rollbus.services.gym_runner.adapter_client import AdapterClient, AdapterError
from rollbus.services.gym_runner.gym import (
    BAD_ENV_CONFIG,
    REQUEST_FIELDS,
    Episode,
    GymConfigError,
    RolloutInferRequest,
    close_env,
    make_context_manager,
    make_env,
    parse_config,
    run_episode,
)
from rollbus.services.gym_runner.settings import GymRunnerSettings

log = logging.getLogger(__name__)
RETRIED = ("model_error", "timeout", "adapter_error")
MAX_DETAILS_CHARS = 1_000_000  # the conversation is dropped from details above this (the turns have it)
Publish = Callable[[str, RewardEvent], Awaitable[Any]]


@dataclass(frozen=True)
class GymRow:
    """A task as ms-swift's dataset row: ``messages``, ``env_config``, ``ctx_config`` plus the rest."""

    env_config: dict[str, Any] | None
    ctx_config: dict[str, Any] | None
    request: RolloutInferRequest

    @classmethod
    def from_task(cls, task: TaskEvent) -> GymRow:
        env_config = parse_config(task.env_config, "env_config")
        ctx_config = parse_config(task.ctx_config, "ctx_config")
        return cls(env_config, ctx_config, request_for(task, env_config, ctx_config))


def request_for(
    task: TaskEvent, env_config: dict[str, Any] | None, ctx_config: dict[str, Any] | None
) -> RolloutInferRequest:
    """The row back from the task, as ms-swift turns a row into a request: its request columns (media,
    ``tools``, ``objects``) become fields, every other column (the task's ``metadata``: what ``gym-submit``
    kept of the row; ``env_config`` / ``ctx_config`` when the row had them) goes to ``data_dict``, None
    values dropped, a ``data_dict`` column merged over them; a trailing assistant message (the dataset's
    response) is not part of the prompt. Only a row's ``uuid`` differs: the request's is the rollout id,
    so the row's stays in ``data_dict``."""
    row = parse_config(task.metadata, "metadata") or {}
    columns = {"env_config": env_config or None, "ctx_config": ctx_config or None, **row}
    data = {k: v for k, v in columns.items() if v is not None and k != "data_dict"}
    fields = {k: data.pop(k) for k in REQUEST_FIELDS if k in data and k not in ("uuid", "messages")}
    if "data_dict" in row and not isinstance(row["data_dict"], dict):
        raise GymConfigError("data_dict must be a JSON object")
    data.update(row.get("data_dict") or {})
    tools = fields.get("tools")
    if isinstance(tools, str):
        with contextlib.suppress(ValueError):
            fields["tools"] = json.loads(tools)
    for media in ("images", "audios", "videos"):
        if isinstance(fields.get(media), str):
            fields[media] = [fields[media]]
    messages = _messages(task)
    if messages and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    return RolloutInferRequest(messages, data_dict=data, uuid=task.rollout_id, **fields)


def _messages(task: TaskEvent) -> list[dict[str, Any]]:
    if task.messages is None:
        return [{"role": "user", "content": task.prompt}]
    try:
        messages = json.loads(task.messages)
    except json.JSONDecodeError as exc:
        raise GymConfigError(f"messages is not valid JSON: {exc}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise GymConfigError("messages must be a JSON list of message objects")
    return messages


@dataclass
class EpisodeResult:
    episode: Episode
    attempt_id: str
    attempts: int
    failure_kind: str | None
    env_name: str | None


class GymRunner:
    def __init__(self, settings: GymRunnerSettings, adapter: AdapterClient, publish: Publish) -> None:
        self.settings, self.adapter, self.publish = settings, adapter, publish

    async def run_task(self, task: TaskEvent) -> RewardEvent:
        """Run the task's attempts and publish its reward; returns the reward record. A bug in the runner
        still ends in a reward naming it (``runner_error``): nothing is dropped (a task the codec cannot
        read never gets here: it is dead-lettered)."""
        try:
            record = reward_record(task, await self.attempts(task), self.settings.loss_scope)
        except Exception as exc:
            log.exception("%s: the runner failed", task.rollout_id)
            failed = EpisodeResult(Episode(error=f"{type(exc).__name__}: {exc}"), "", 0, "runner_error", None)
            record = reward_record(task, failed, self.settings.loss_scope)
        await self.publish("rewards", record)
        return record

    async def attempts(self, task: TaskEvent) -> EpisodeResult:
        rollout = task.rollout_id
        outcome = None
        for attempt in range(1, self.settings.attempts + 1):
            attempt_id = f"{rollout}.a{attempt}.{uuid.uuid4().hex[:6]}"
            outcome = await self.attempt(task, attempt_id, attempt)
            if outcome.failure_kind not in RETRIED:
                break
            log.warning("%s attempt %d failed (%s): %s", rollout, attempt, outcome.failure_kind,
                        outcome.episode.error)  # fmt: skip
        assert outcome is not None
        return outcome

    async def attempt(self, task: TaskEvent, attempt_id: str, number: int) -> EpisodeResult:
        settings = self.settings
        try:
            row = GymRow.from_task(task)
            env = make_env(row.env_config, settings.gym_env)
            manager = make_context_manager(row.ctx_config, settings.context_manager)
        except GymConfigError as exc:  # the env's own constructor raising is in its traceback
            log.error("%s: %s: %s", task.rollout_id, BAD_ENV_CONFIG, exc, exc_info=exc.__cause__)
            failed = Episode(stop="done", error=str(exc))
            return EpisodeResult(failed, attempt_id, number, BAD_ENV_CONFIG, None)
        name = (row.env_config or {}).get("name") or settings.gym_env
        rollout = task.rollout_id
        episode = Episode()
        try:
            await self._close_session(rollout, None)  # what a dead runner's attempt left open ends first
            token = await self.adapter.open(rollout, attempt_id)
        except BaseException as exc:
            await close_env(env, episode)  # it was made: its close is owed even if nothing ran
            if not isinstance(exc, AdapterError):
                raise
            episode.stop, episode.error = "done", str(exc)
            return EpisodeResult(episode, attempt_id, number, "adapter_error", name)
        try:
            episode = await run_episode(
                env, row.request, self.adapter.model_call(token), max_turns=settings.max_turns,
                context_manager=manager, trajectory_id=rollout, timeout=settings.episode_timeout,
                episode=episode,
            )  # fmt: skip
        finally:
            await asyncio.shield(self._close_session(rollout, attempt_id))
        return EpisodeResult(episode, attempt_id, number, episode.failure_kind, name)

    async def _close_session(self, rollout: str, attempt_id: str | None) -> None:
        try:
            await self.adapter.close(rollout, attempt_id)
        except AdapterError as exc:
            log.warning("%s: %s (the adapter's idle expiry will close it)", rollout, exc)


def reward_record(task: TaskEvent, outcome: EpisodeResult, loss_scope: str) -> RewardEvent:
    episode = outcome.episode
    details: dict[str, Any] = {
        "kind": "gym",
        "env": outcome.env_name,
        "stop": episode.stop if outcome.failure_kind != BAD_ENV_CONFIG else None,
        "error": episode.error,
        "turns": episode.turns,
        "attempts": outcome.attempts,
        "loss_scope": loss_scope,
        "messages": episode.messages,
    }
    text = json.dumps(details, default=str)
    if len(text) > MAX_DETAILS_CHARS:
        details.update(messages=None, messages_omitted=True)
        text = json.dumps(details, default=str)
    said = [info["solved"] for info in episode.infos[1:] if "solved" in info]
    solved = any(s is True for s in said) if said else (episode.stop == "done" and episode.reward > 0)
    return reward_event(
        rollout_id=task.rollout_id, attempt_id=outcome.attempt_id, group_id=task.group_id,
        group_size=task.group_size, reward=episode.reward, solved=solved,
        applied_cleanly=outcome.failure_kind is None, details=text, failure_kind=outcome.failure_kind,
        cause=outcome.failure_kind, step_rewards=episode.step_rewards,
        infos=json.dumps(episode.infos, default=str),
    )  # fmt: skip  # no rerun_rollout_id: retried in-process (``--attempts``)
