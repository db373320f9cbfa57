"""Rollout routing replay (R3) for Qwen3-MoE: the trainer's MoE layers use the experts the rollout used.

Router logits of nearly tied experts flip with the smallest numeric difference between the engine and the
trainer (kernels, precision, batch shape), and a flipped expert changes the token's whole MLP output: the
largest source of train/inference mismatch in MoE RL. Replay records each MoE layer's top-k at rollout time
and forces it here; the gate weights are recomputed from the trainer's own router logits over the forced
experts (softmax over all experts, gathered, renormalised as the model's ``norm_topk_prob`` says), so the
router still receives gradients.

Forcing is done with a *forward hook* (``register_forward_hook``, a documented hook that may replace a
module's output) on each ``Qwen3MoeTopKRouter`` (``layers[i].mlp.gate`` in transformers' Qwen3-MoE, the only
place top-k is chosen): it keeps the router's logits and replaces its ``(weights, indices)``. No forward is
rewritten, and a layer that is dense (``mlp_only_layers``) simply has no router to hook.

Recorded experts are ``[positions, layers, top_k]`` integers, SGLang's layout (``meta_info["routed_experts"]``
decoded): row ``p`` is position ``p`` of prompt+response, for positions ``0..T-2`` (the last token is never
fed forward at sampling time; it predicts nothing in training either, so its row is filled with any valid
experts); a ``T``-row array is taken as is. Rows of dense layers are ignored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter


class InvalidRoutes(ValueError):
    """Recorded experts that cannot be replayed on this model; the message says why."""


def routers(model: PreTrainedModel) -> dict[int, Qwen3MoeTopKRouter]:
    """Decoder layer index -> its router, for the model's MoE layers (empty for a dense model)."""
    found = {}
    for index, layer in enumerate(getattr(model, model.base_model_prefix).layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, Qwen3MoeTopKRouter):
            found[index] = gate
    return found


@dataclass(frozen=True)
class MoeShape:
    """What recorded experts must fit: every decoder layer's row (dense layers' rows are ignored), ``top_k``
    ids per row, each below ``experts``, distinct within a row at the ``moe_layers``."""

    layers: int
    top_k: int
    experts: int
    moe_layers: tuple[int, ...]

    @classmethod
    def of(cls, model: PreTrainedModel) -> MoeShape | None:
        found = routers(model)
        if not found:
            return None
        config = model.config
        return cls(int(config.num_hidden_layers), int(config.num_experts_per_tok), int(config.num_experts),
                   tuple(found))  # fmt: skip


def check_routes(routes: torch.Tensor, tokens: int, shape: MoeShape) -> None:
    """Raise :class:`InvalidRoutes` unless ``routes`` can be replayed over a ``tokens``-token segment."""
    layers, top_k, experts = shape.layers, shape.top_k, shape.experts
    if routes.dim() != 3 or routes.shape[1:] != (layers, top_k):
        raise InvalidRoutes(
            f"routed experts of shape {tuple(routes.shape)}, expected [positions, {layers}, {top_k}]"
        )
    if routes.shape[0] not in (tokens - 1, tokens):
        raise InvalidRoutes(
            f"routed experts cover {routes.shape[0]} positions, the segment has {tokens} tokens"
        )
    if routes.is_floating_point() or routes.is_complex() or routes.dtype == torch.bool:
        raise InvalidRoutes(f"routed experts must be integers, not {routes.dtype}")
    used = routes[:, list(shape.moe_layers)].long()
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= experts):
        raise InvalidRoutes(f"an expert id outside 0..{experts - 1}")
    ordered = used.sort(-1).values
    if not bool((ordered[..., 1:] != ordered[..., :-1]).all()):
        raise InvalidRoutes("an expert repeated within one position's top-k")


class RoutingReplay:
    """Hooks on every router of ``model``; inert except inside :meth:`replaying`."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.routers = routers(model)
        shape = MoeShape.of(model)
        if shape is None:
            raise InvalidRoutes("routing replay needs a Qwen3-MoE model; this one has no router")
        self.shape = shape
        self._routes: torch.Tensor | None = None  # [tokens, layers, top_k] int64, on the model's device
        self._agreed: torch.Tensor | None = None  # per position: the router's own top-k was the recorded one
        self._recorded = 0  # positions with a recorded row (the padded last one is not)
        self._handles = [
            gate.register_forward_hook(self._hook(index)) for index, gate in self.routers.items()
        ]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    @contextlib.contextmanager
    def replaying(self, routes: torch.Tensor, tokens: int) -> Iterator[bool]:
        """Force ``routes`` (``[tokens-1 or tokens, layers, top_k]``) for every forward (and the recompute in
        backward) of one ``tokens``-token sequence inside the block."""
        check_routes(routes, tokens, self.shape)
        routes = routes.long()
        self._recorded = routes.shape[0]
        if routes.shape[0] == tokens - 1:  # the last token's row: any valid experts, it predicts nothing
            routes = torch.cat([routes, routes[-1:]]) if len(routes) else routes
        self._routes = routes.to(next(iter(self.routers.values())).weight.device)
        self._agreed = None
        try:
            yield True
        finally:
            self._routes = None

    def agreement(self) -> tuple[int, int]:
        """Of the recorded positions of the sequence replayed last, how many the trainer's routers would have
        sent to the same experts in every MoE layer (sets, not order), and how many there were: how often
        replay changed nothing. Valid after a forward inside :meth:`replaying` (a recompute in backward sees
        the same logits, so it changes nothing)."""
        if self._agreed is None:
            return 0, 0
        return int(self._agreed[: self._recorded].sum()), self._recorded

    def _hook(self, layer: int) -> Any:
        def replace(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> Any:
            if self._routes is None:
                return None  # the router's own choice
            logits = output[0]  # [tokens, experts]: the trainer runs one sequence at a time
            indices = self._routes[:, layer, :]
            if indices.shape[0] != logits.shape[0]:
                raise InvalidRoutes(
                    f"routes for {indices.shape[0]} positions, the router saw {logits.shape[0]}"
                )
            own = output[2].sort(-1).values == indices.sort(-1).values
            agreed = own.all(-1)
            self._agreed = agreed if self._agreed is None else self._agreed & agreed
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(1, indices)
            if module.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), indices

        return replace
