"""Settings of ``rollbus gym-runner`` (flags ``--x-y``, variables ``ROLLBUS_GYM_RUNNER_X_Y``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from rollbus.settings import ADAPTER_URL, BusSettings


class GymRunnerSettings(BusSettings):
    """Settings of ``rollbus gym-runner``."""

    model_config = BusSettings.scoped("gym-runner")

    adapter_url: str = Field(ADAPTER_URL, min_length=1, description="adapter base URL")
    admin_token: SecretStr | None = Field(None, description="the adapter's --admin-token (required)")
    model: str = Field("rollbus-engine", min_length=1, description="model name sent with each model call")
    gym_env: str | None = Field(None, description="env for rows whose env_config has no name")
    context_manager: str | None = Field(None, description="context manager for rows without ctx_config.name")
    external_plugins: str = Field(
        "", description="comma-separated .py files registering envs (loaded after the built-ins: theirs win)"
    )
    max_turns: int = Field(8, gt=0, description="model calls per episode at most")
    max_tokens: int = Field(1024, gt=0, description="tokens one model call may sample")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="sampling temperature")
    loss_scope: Literal["all_turns", "last_turn"] = Field(
        "all_turns", description="turns trained (in the reward's details.loss_scope)"
    )
    concurrency: int = Field(4, gt=0, description="episodes run at once")
    episode_timeout: float = Field(600.0, gt=0, description="seconds one episode attempt may take")
    attempts: int = Field(2, ge=1, description="attempts per task when one fails on model_error/timeout")
    request_timeout: float = Field(600.0, gt=0, description="seconds one model call may take")
    busy_retries: int = Field(5, ge=0, description="retries of a model call refused as busy (429/503/529)")
    drain_timeout: float = Field(30.0, ge=0, description="seconds episodes may finish in at shutdown")
    consumer_group: str = Field("gym-runner", min_length=1, description="Kafka consumer group on tasks")

    def plugin_paths(self) -> list[str]:
        return [p.strip() for p in self.external_plugins.split(",") if p.strip()]
