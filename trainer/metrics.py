"""Per-step metrics: a console line, a JSONL row, and a PNG of reward and loss redrawn as training goes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONSOLE_KEYS = (
    "step", "version", "reward_mean", "solve_rate", "loss", "tokens_trained", "masked_fraction",
    "clip_fraction", "approx_kl", "entropy", "grad_norm", "staleness_mean", "wait_s", "step_s",
)  # fmt: skip


class MetricsLog:
    """Appends to ``metrics.jsonl`` and redraws ``metrics.png`` in ``directory`` after every step."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.jsonl = directory / "metrics.jsonl"
        self.png = directory / "metrics.png"

    def write(self, row: dict[str, Any]) -> None:
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(console_line(row), flush=True)
        self.plot()

    def rows(self) -> list[dict[str, Any]]:
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line.strip()]

    def plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = self.rows()
        steps = [r["step"] for r in rows]
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
        top.plot(steps, [r["reward_mean"] for r in rows], marker="o")
        top.set_ylabel("reward mean")
        bottom.plot(steps, [r["loss"] for r in rows], marker="o", color="tab:red")
        bottom.set_ylabel("loss")
        bottom.set_xlabel("step")
        fig.tight_layout()
        tmp = self.png.with_suffix(".png.tmp")
        fig.savefig(tmp, format="png")
        plt.close(fig)
        os.replace(tmp, self.png)


def console_line(row: dict[str, Any]) -> str:
    parts = []
    for key in CONSOLE_KEYS:
        value = row.get(key)
        parts.append(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}")
    return "trainer: " + " ".join(parts)
