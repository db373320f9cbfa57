"""One optimiser step over a batch of segments, on one process or data-parallel across ``torchrun`` ranks.

Each rank computes the loss of its share of the batch (the reducer weights are global, so shares simply add),
then the gradients are summed across ranks with one all-reduce of a flat buffer, clipped, and every rank takes
the same AdamW step. The explicit all-reduce (rather than wrapping the model in ``DistributedDataParallel``)
lets ranks hold different numbers of segments: DDP needs the same number of backward passes on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from trainer.loss import LossConfig, LossStats, SegmentInput, batch_loss


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


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def make_optimizer(model: PreTrainedModel, config: OptimConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, betas=config.betas, foreach=False
    )


def all_reduce_grads(model: PreTrainedModel) -> None:
    """Sum every parameter's gradient across ranks, in one flat buffer."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    share: list[SegmentInput],
    loss_config: LossConfig,
    optim_config: OptimConfig,
) -> StepResult:
    """Accumulate this rank's share, reduce across ranks, clip, step; the result is the global view."""
    model.train()
    optimizer.zero_grad(set_to_none=False)
    loss, stats = batch_loss(model, share, loss_config)
    for p in model.parameters():
        if p.grad is None:  # a rank without segments, or an unused weight: same step everywhere
            p.grad = torch.zeros_like(p)
    if distributed():
        all_reduce_grads(model)
        totals = torch.tensor([loss, *stats.as_list()], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        loss, stats = float(totals[0]), LossStats.from_list(totals[1:].tolist())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim_config.max_grad_norm)
    optimizer.step()
    model.eval()
    return StepResult(loss=loss, grad_norm=float(grad_norm), stats=stats)
