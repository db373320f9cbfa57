"""The model, its optimiser and the resumable state: what every rank holds, built identically everywhere.

Rank 0 (the :class:`trainer.service.Trainer`) decides each step's batch and hands every rank its share with
one ``broadcast_object_list``; the other ranks run :func:`follow`, stepping on whatever rank 0 sends until it
sends the stop word. Every rank starts from the same checkpoint (or the same seeded random model).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from rollbus.policy_model import random_qwen3
from rollbus.tokenizer import SpecialIds, load_tokenizer
from trainer import checkpoint
from trainer.checkpoint import TrainerState
from trainer.loss import SegmentInput
from trainer.settings import TrainerSettings
from trainer.step import StepResult, distributed, make_optimizer, train_step

log = logging.getLogger("rollbus.trainer")
STOP = "stop"


class Learner:
    """Model + AdamW + :class:`TrainerState`; ``step`` trains this rank's share of a batch."""

    def __init__(self, settings: TrainerSettings, model: PreTrainedModel, state: TrainerState) -> None:
        self.settings = settings
        self.model = model
        self.optimizer = make_optimizer(model, settings.optim())
        self.state = state
        self.rank = dist.get_rank() if distributed() else 0
        self.world_size = dist.get_world_size() if distributed() else 1

    @classmethod
    def resume(cls, settings: TrainerSettings) -> Learner:
        """From the newest checkpoint if there is one, else the initial model at version 0."""
        path = checkpoint.latest(settings.checkpoints())
        if path is None:
            return cls(settings, initial_model(settings), TrainerState())
        model, optimizer_state, state = checkpoint.load(path)
        learner = cls(settings, model, state)
        learner.optimizer.load_state_dict(optimizer_state)
        log.info("resumed from %s (version %d, step %d)", path, state.version, state.step)
        return learner

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def step(self, shares: list[list[SegmentInput]] | None) -> StepResult:
        """Train one batch; on rank 0 ``shares`` holds every rank's share and is broadcast first."""
        if distributed():
            box: list[Any] = [shares]
            dist.broadcast_object_list(box, src=0)
            shares = box[0]
        assert shares is not None
        return self.train(shares[self.rank])

    def train(self, share: list[SegmentInput]) -> StepResult:
        return train_step(self.model, self.optimizer, share, self.settings.loss(), self.settings.optim())

    def save(self, keep: int) -> Path:
        return checkpoint.save(self.settings.checkpoints(), self.model, self.optimizer, self.state, keep)


def initial_model(settings: TrainerSettings) -> PreTrainedModel:
    """``--model-path`` if given, else the engine's random Qwen3 for the same seed and shape."""
    if settings.model_path is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=torch.float32)
    tokenizer = load_tokenizer(settings.tokenizer)
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    return random_qwen3(settings.model_spec(), len(tokenizer), stops, settings.seed)


def stop_followers() -> None:
    if distributed():
        dist.broadcast_object_list([STOP], src=0)


def follow(learner: Learner) -> int:
    """Ranks other than 0: step on every batch rank 0 broadcasts, until it says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if box[0] == STOP:
            return 0
        learner.train(box[0][learner.rank])
