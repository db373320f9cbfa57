"""Per-step metrics: a console line, a JSONL row, and a PNG of reward and loss redrawn as training goes; the
gym info dicts the step's rollouts carried go to ``infos.jsonl`` beside them."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rollbus.events import BadRecord, TrainStepEvent
from rollbus.trainer.loss import LossStats

CONSOLE_KEYS = (
    "step", "version", "reward_mean", "solve_rate", "loss", "tokens_trained", "masked_fraction",
    "clip_fraction", "approx_kl", "logprob_diff_max", "ratio_outside_fraction", "entropy", "grad_norm",
    "staleness_mean", "wait_s", "step_s",
)  # fmt: skip


def mismatch(stats: LossStats) -> dict[str, float]:
    """How far the trainer's log-probabilities are from the rollout's on the trained tokens: the first numbers
    to read when a run diverges. (``approx_kl``, the k3 estimate of KL(rollout || trainer), is the fourth.)
    ``replayed_fraction``: tokens trained on the rollout's MoE routing (0 for a dense model or replay off);
    ``unreplayed_*``: the replayed tokens' figures had the trainer routed on its own (what replay saves);
    ``routing_agreement``: the fraction of replayed positions whose recorded experts the trainer's routers
    chose too, in every MoE layer."""
    tokens = max(stats.tokens, 1.0)
    row = {
        "logprob_diff_mean": stats.abs_diff / tokens,
        "logprob_diff_max": stats.abs_diff_max,
        "ratio_outside_fraction": stats.ratio_outside / tokens,
        "replayed_fraction": stats.replayed / tokens,
    }
    if stats.route_positions:  # replayed: how often the trainer's own routing was the rollout's already
        row["routing_agreement"] = stats.routes_agreed / stats.route_positions
    if stats.unreplayed_tokens:  # --mismatch-unreplayed: the same tokens on the trainer's own routing
        own = stats.unreplayed_tokens
        row.update(
            unreplayed_logprob_diff_mean=stats.unreplayed_abs_diff / own,
            unreplayed_logprob_diff_max=stats.unreplayed_abs_diff_max,
            unreplayed_approx_kl=stats.unreplayed_approx_kl / own,
            unreplayed_ratio_outside_fraction=stats.unreplayed_ratio_outside / own,
        )
    return row


def step_fact(row: Mapping[str, Any]) -> TrainStepEvent | None:
    """The step's record on ``train-steps``: the fields of its log row the event names, so the bus and
    ``metrics.jsonl`` never disagree; a field the row lacks takes the event's default (``routing_agreement``:
    null when nothing was replayed). None for a row missing a field with no default: a checkpoint written
    before the trainer published its steps."""
    try:
        return TrainStepEvent.from_dict({name: row[name] for name in _STEP_FIELDS if name in row})
    except BadRecord:
        return None


_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(TrainStepEvent))


class MetricsLog:
    """Appends to ``metrics.jsonl`` in ``directory``; :meth:`plot` redraws ``metrics.png`` from it."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.jsonl = directory / "metrics.jsonl"
        self.png = directory / "metrics.png"
        self.infos = directory / "infos.jsonl"

    def write_infos(self, rows: list[dict[str, Any]]) -> None:
        """One line per rollout that carried gym info dicts; nothing (no file) for coding-agent steps."""
        if rows:
            with self.infos.open("a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)

    def write(self, row: dict[str, Any]) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(console_line(row), flush=True)

    def rows(self) -> list[dict[str, Any]]:
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]

    def plot(self) -> None:
        """Redraw the PNG (a ``Figure`` of its own, not pyplot's global state: this runs in a thread)."""
        from matplotlib.figure import Figure

        rows = self.rows()
        steps = [r["step"] for r in rows]
        fig = Figure(figsize=(7, 5))
        top, bottom = fig.subplots(2, 1, sharex=True)
        top.plot(steps, [r["reward_mean"] for r in rows], marker="o")
        top.set_ylabel("reward mean")
        bottom.plot(steps, [r["loss"] for r in rows], marker="o", color="tab:red")
        bottom.set_ylabel("loss")
        bottom.set_xlabel("step")
        fig.tight_layout()
        tmp = self.png.with_suffix(".png.tmp")
        fig.savefig(tmp, format="png")
        os.replace(tmp, self.png)


def console_line(row: dict[str, Any]) -> str:
    parts = []
    for key in CONSOLE_KEYS:
        value = row.get(key)
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return "trainer: " + " ".join(parts)


def info_rows(segments: Iterable[Mapping[str, Any]], step: int, version: int) -> list[dict[str, Any]]:
    """The ``infos.jsonl`` lines of one step: each rollout's ``final`` segment's infos (the segmenter puts
    them there and nowhere else), in the batch's order. "[]" (coding-agent rollouts, writers before segment
    v3) writes nothing. Infos that are not a JSON list are logged as the raw string with ``malformed``, never
    dropped and never a crash: the trainer log is no place to stop training."""
    rows = []
    for segment in segments:
        raw = segment.get("infos") or "[]"
        if segment.get("kind") != "final" or raw == "[]":
            continue
        row = {"step": step, "version": version, "rollout_id": segment["rollout_id"],
               "reward": segment["trajectory_reward"]}  # fmt: skip
        try:
            infos = json.loads(raw)
        except ValueError:
            infos = None
        if isinstance(infos, list):
            row["infos"] = infos
        else:
            row.update(infos=raw, malformed=True)
        rows.append(row)
    return rows


def info_count(rows: list[dict[str, Any]]) -> int:
    """How many info dicts the step logged (a malformed rollout's infos count as none)."""
    return sum(len(row["infos"]) for row in rows if not row.get("malformed"))
