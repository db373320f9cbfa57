"""The one settings class of ``rollbus segmenter`` (flags ``--x-y``, variables ``ROLLBUS_SEGMENTER_X_Y``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollbus.services.segmenter.segmentation import Options
from rollbus.settings import BusSettings


class SegmenterSettings(BusSettings):
    """Settings of `rollbus segmenter` and `rollbus rebuild segments` (one declaration for both)."""

    model_config = BusSettings.scoped("segmenter")

    loss_scope: Literal["all_turns", "last_turn"] = Field(
        "all_turns", description="which sampled outputs train when the reward names no details.loss_scope"
    )
    history_mode: Literal["canonical", "rerender"] = Field(
        "canonical", description="how the adapter recorded histories (must match its --history-mode)"
    )
    rollout_timeout: float = Field(
        3600.0,
        gt=0,
        description="seconds a rollout may stay incomplete after its last event before it aborts",
    )
    forget_after: float = Field(
        3600.0,
        gt=0,
        description="seconds after its last event a finished rollout's sealed state is kept to recognise "
        "late events (~1 KB each: memory grows with finished rollouts per second times this); a later event "
        "starts a new rollout, which times out with nothing trainable",
    )
    tick_interval: float = Field(10.0, gt=0, description="seconds between timeout sweeps")
    store: str = Field("memory://", description="Faust table store: memory:// or rocksdb:// (rocksdict)")
    commit_interval: float = Field(
        3.0,
        gt=0,
        description="seconds between offset commits (at_least_once; Faust's own default is 2.8): a crash "
        "re-reads at most this much, which re-cuts identical segments; each commit wakes the worker and its "
        "consumer thread, so an idle worker's CPU falls with a longer interval (1 s: ~5.75 CPU-ms/s, 3 s: "
        "~5.25, bench/rollout_cost.py)",
    )
    session_timeout: float = Field(
        15.0,
        ge=6.0,
        le=90.0,
        description="seconds without heartbeats before the group counts a worker gone; a killed worker's "
        "partitions wait this long for a new owner (the broker's minimum is 6)",
    )
    changelog_timeout: float = Field(
        60.0, gt=0, description="seconds a commit waits for table changelog writes before the worker stops"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="worker log level")

    def options(self) -> Options:
        return Options(
            loss_scope=self.loss_scope,
            history_mode=self.history_mode,
            timeout_ms=int(self.rollout_timeout * 1000),
            forget_after_ms=int(self.forget_after * 1000),
        )
