"""One optimiser step over a batch of segments, in one process or sharded across ``torchrun`` ranks.

Each rank computes the loss of its share of the batch (the reducer weights are global, so shares simply add).
Under FSDP2 (:mod:`rollbus.trainer.sharding`) every layer's backward reduce-scatters its gradient, so each
rank ends with the summed gradient of its parameter shard; the norm is clipped over all shards and every rank
takes the AdamW step of its shard. Ranks holding fewer segments run fillers, so all take the same collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rollbus.trainer.device import Placement, autocast
from rollbus.trainer.loss import LossConfig, LossStats, PolicyForward, SegmentInput, batch_loss
from rollbus.trainer.sharding import distributed


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    stats: LossStats


def make_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=config.betas, foreach=False
    )


def train_step(
    forward: PolicyForward,
    optimizer: torch.optim.Optimizer,
    share: list[SegmentInput],
    loss_config: LossConfig,
    optim_config: OptimConfig,
    where: Placement,
) -> StepResult:
    """Accumulate this rank's share, clip, step; the result is the global view."""
    forward.train()
    optimizer.zero_grad(set_to_none=False)
    with autocast(where, sharded=distributed()):
        loss, stats = batch_loss(forward, share, loss_config)
    for p in forward.parameters():
        if p.grad is None:  # an unused weight: the same (zero) step everywhere
            p.grad = torch.zeros_like(p)
    if distributed():
        sums = torch.tensor([loss, *stats.sums()], dtype=torch.float64, device=where.device)
        maxes = torch.tensor(stats.maxes(), dtype=torch.float64, device=where.device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        loss, stats = float(sums[0]), LossStats.from_lists(sums[1:].tolist(), maxes.tolist())
    grad_norm = torch.nn.utils.clip_grad_norm_(list(forward.parameters()), optim_config.max_grad_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    forward.eval()
    return StepResult(loss=loss, grad_norm=float(grad_norm), stats=stats)
