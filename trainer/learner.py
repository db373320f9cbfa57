"""The model, its optimiser and the resumable state: what every rank holds, built identically everywhere.

Rank 0 (the :class:`rollbus.trainer.service.Trainer`) decides what every rank does next and says so with one
``broadcast_object_list``: train a batch (every rank its share), save a checkpoint (every rank gives its
shards, rank 0 writes), or stop. The other ranks run :func:`follow`. Every rank starts from the same
checkpoint (or the same seeded random model), then shards it (:mod:`rollbus.trainer.sharding`).
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
from rollbus.trainer import checkpoint
from rollbus.trainer.checkpoint import TrainerState
from rollbus.trainer.device import placement
from rollbus.trainer.expert_precision import cast_experts_under_autocast
from rollbus.trainer.loss import PolicyForward, SegmentInput
from rollbus.trainer.moe import random_qwen3_moe
from rollbus.trainer.routing_replay import MoeShape, RoutingReplay
from rollbus.trainer.settings import TrainerSettings
from rollbus.trainer.sharding import (
    distributed,
    even_shares,
    full_model_state,
    full_optimizer_state,
    load_optimizer_state,
    shard,
)
from rollbus.trainer.step import StepResult, make_optimizer, train_step

log = logging.getLogger("rollbus.trainer")
STOP, TRAIN, SAVE = "stop", "train", "save"


class Learner:
    """Model + AdamW + :class:`TrainerState`; ``step`` trains this rank's share of a batch."""

    def __init__(
        self,
        settings: TrainerSettings,
        model: PreTrainedModel,
        state: TrainerState,
        optimizer_state: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.where = placement(settings.device, settings.precision)
        # transformers wraps PreTrainedModel.to in a decorator whose type takes self as an argument
        self.model = model.to(self.where.device)  # type: ignore[arg-type]
        if settings.activation_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.moe_shape = MoeShape.of(model)
        self.replay = RoutingReplay(model) if self.moe_shape and settings.routing_replay else None
        self.forward = PolicyForward(model, self.replay)
        if self.where.mixed and not distributed():  # FSDP2's policy casts them when sharded
            cast_experts_under_autocast(model)
        self.rank = dist.get_rank() if distributed() else 0
        self.world_size = dist.get_world_size() if distributed() else 1
        if distributed():
            shard(self.forward, self.where)
        self.optimizer = make_optimizer(self.forward, settings.optim())
        if optimizer_state is not None:
            if all(isinstance(k, int) for k in optimizer_state["state"]):  # written by index, before FSDP2
                self.optimizer.load_state_dict(optimizer_state)
            else:
                load_optimizer_state(self.forward, self.optimizer, optimizer_state)
        self.state = state

    @classmethod
    def resume(cls, settings: TrainerSettings) -> Learner:
        """From the newest checkpoint if there is one, else the initial model at version 0."""
        path = checkpoint.latest(settings.checkpoints())
        if path is None:
            return cls(settings, initial_model(settings), TrainerState())
        model, optimizer_state, state = checkpoint.load(path)
        learner = cls(settings, model, state, optimizer_state)
        log.info("resumed from %s (version %d, step %d)", path, state.version, state.step)
        return learner

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def step(self, shares: list[list[SegmentInput]] | None) -> StepResult:
        """Train one batch; on rank 0 ``shares`` holds every rank's share and is broadcast first."""
        if distributed():
            box: list[Any] = [(TRAIN, shares)]
            dist.broadcast_object_list(box, src=0)
            shares = box[0][1]
        assert shares is not None
        return self.train(shares)

    def train(self, shares: list[list[SegmentInput]]) -> StepResult:
        share = even_shares(shares)[self.rank] if distributed() else shares[self.rank]
        settings = self.settings
        return train_step(self.forward, self.optimizer, share, settings.loss(), settings.optim(), self.where)

    def save(self, keep: int) -> Path:
        """Write the current version (rank 0; under torchrun every rank gives its shards first)."""
        if distributed():
            dist.broadcast_object_list([(SAVE, None)], src=0)
        path = self.gather_and_write(keep)
        assert path is not None
        return path

    def gather_and_write(self, keep: int) -> Path | None:
        weights = full_model_state(self.model)
        optimizer_state = full_optimizer_state(self.forward, self.optimizer)
        if self.rank != 0:
            return None
        return checkpoint.save(
            self.settings.checkpoints(), self.model, weights, optimizer_state, self.state, keep
        )


def initial_model(settings: TrainerSettings) -> PreTrainedModel:
    """``--model-path`` if given (a Qwen3 or Qwen3-MoE directory), else a random model for the seed and shape:
    the engine's random Qwen3, or with ``--moe-experts N`` a random Qwen3-MoE."""
    if settings.model_path is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(settings.model_path, dtype=torch.float32)
    tokenizer = load_tokenizer(settings.tokenizer)
    stops = SpecialIds.from_tokenizer(tokenizer).stop_token_ids
    moe = settings.moe_spec()
    if moe is not None:
        return random_qwen3_moe(settings.model_spec(), moe, len(tokenizer), stops, settings.seed)
    return random_qwen3(settings.model_spec(), len(tokenizer), stops, settings.seed)


def stop_followers() -> None:
    if distributed():
        dist.broadcast_object_list([(STOP, None)], src=0)


def follow(learner: Learner) -> int:
    """Ranks other than 0: do what rank 0 broadcasts (train a batch, give shards to a save), until stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        command, shares = box[0]
        if command == STOP:
            return 0
        if command == SAVE:
            learner.gather_and_write(0)
        else:
            learner.train(shares)
