"""Versioned checkpoints on disk: the weights the engine loads, plus everything a resumed trainer needs.

Each policy version is one directory ``v00000007/`` in the Hugging Face layout (``config.json``,
``model.safetensors``, or shards with their ``model.safetensors.index.json`` past ``MAX_SHARD``: what
``from_pretrained`` and ``/update_weights_from_disk`` read) plus ``optimizer.pt`` (AdamW's state keyed by
parameter name) and ``trainer_state.json``. The weights arrive already gathered from the ranks' shards
(:mod:`rollbus.trainer.sharding`), so one consolidated checkpoint is written however many ranks trained it.
It is written under a temporary name, every file and the directory fsynced, then renamed into place: a
directory with a final name is complete, whatever instant the trainer died at. Only after that rename may the
step's offsets be committed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
_NAME = re.compile(r"^v(\d{8})$")
MAX_SHARD = "5GB"  # safetensors file size before the weights are split into shards with an index


@dataclass
class TrainerState:
    """What a resume needs besides weights and optimizer: the counters and which groups are done."""

    version: int = 0
    step: int = 0
    # trained, dropped as stale, or skipped -> the segment time (ms) they finished at
    finished_groups: dict[str, int] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # this step's log row, rewritten if lost in a crash

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerState:
        finished = data.get("finished_groups", {})
        if isinstance(finished, list):  # written before groups carried their finish time: remembered from now
            now = int(time.time() * 1000)
            data = {**data, "finished_groups": dict.fromkeys(finished, now)}
        return cls(**data)


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: Path,
    model: PreTrainedModel,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    state: TrainerState,
    keep: int,
) -> Path:
    """Write version ``state.version`` durably and atomically (``weights``: the full state dict of ``model``,
    whose config and tied-weight layout ``save_pretrained`` uses); prune all but the newest ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    final = version_dir(root, state.version)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=weights, safe_serialization=True, max_shard_size=MAX_SHARD)
    torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state)))
    for path in tmp.iterdir():
        _fsync(path)
    _fsync(tmp)
    if final.exists():  # a crash after rename but before commit re-trains nothing: same content
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    prune(root, keep)
    return final


def versions(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)))


def latest(root: Path) -> Path | None:
    found = versions(root)
    return version_dir(root, found[-1]) if found else None


def prune(root: Path, keep: int) -> None:
    """Drop old versions (the engine may still be loading the previous one, so keep >= 2)."""
    for version in versions(root)[:-keep]:
        shutil.rmtree(version_dir(root, version), ignore_errors=True)
    for stale in root.glob(".v*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def load(path: Path) -> tuple[PreTrainedModel, dict[str, Any], TrainerState]:
    """Model, optimizer state dict and trainer state of one checkpoint directory."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer_state = torch.load(path / OPTIMIZER_FILE, weights_only=True)
    state = TrainerState.from_json(json.loads((path / STATE_FILE).read_text()))
    return model, optimizer_state, state
