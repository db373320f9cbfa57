"""FSDP2 across ``torchrun`` ranks: each decoder layer and the root are ``fully_shard``-ed units.

Every rank holds 1/N of each parameter (fp32) and of its AdamW state; a layer's full parameters exist only
while it runs (cast to the compute dtype by the mixed-precision policy), and gradients are reduce-scattered in
fp32 and summed, not averaged (the loss weights are global). The root is
:class:`rollbus.trainer.loss.PolicyForward`, so the embeddings, the final norm and a tied LM head form the
root's unit. Ranks must take the same collectives, so every rank runs as many segment passes as the busiest
rank (:func:`even_shares` pads with fillers).

A checkpoint is gathered from the shards with torch's distributed state-dict API (``full_state_dict`` with
``cpu_offload``: only rank 0 keeps the full tensors, on the CPU), then written by rank 0 alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from rollbus.trainer.device import Placement
from rollbus.trainer.loss import PolicyForward, SegmentInput, decoder_of

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shard(root: PolicyForward, where: Placement) -> None:
    """``fully_shard`` every decoder layer, then the root, in place, over all ranks."""
    mesh = init_device_mesh(where.device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=where.compute_dtype, reduce_dtype=torch.float32)
    layers = decoder_of(root.policy).get_submodule("layers")
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"the decoder's layers are a {type(layers).__name__}, not a ModuleList")
    units = [*layers, root]
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    for unit in units:  # shares are weighted globally already: sum the gradients, do not average them
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def full_model_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The whole model's weights on rank 0's CPU (empty elsewhere), a tied weight once under its first name
    (gathered copies no longer share storage, by which ``save_pretrained`` would recognise the tie); every
    rank must call it."""
    if distributed():
        state = get_model_state_dict(model, options=FULL)
        weights = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        if len(weights) != len(state):
            raise TypeError("a full state dict held values that are no tensors")
    else:
        weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            weights.pop(name, None)
    return weights


def full_optimizer_state(root: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW's state keyed by parameter name (so 1 process and N ranks read each other's), on rank 0."""
    return get_optimizer_state_dict(root, optimizer, options=FULL if distributed() else StateDictOptions())


def load_optimizer_state(
    root: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Each rank takes its shard of a full, name-keyed optimizer state."""
    options = StateDictOptions(full_state_dict=True) if distributed() else StateDictOptions()
    set_optimizer_state_dict(root, optimizer, state, options=options)


def filler() -> SegmentInput:
    one = torch.zeros(2, dtype=torch.long)
    return SegmentInput(one, torch.ones(1, dtype=torch.long), torch.zeros(1), 0.0, 0.0, filler=True)


def even_shares(shares: list[list[SegmentInput]]) -> list[list[SegmentInput]]:
    """Pad every share to the longest with fillers: FSDP2's per-layer collectives need equal pass counts."""
    most = max((len(s) for s in shares), default=0)
    return [s + [filler() for _ in range(most - len(s))] for s in shares]
