"""The experts each MoE layer chose, per position, as SGLang's ``--enable-return-routed-experts`` keeps them.

SGLang keeps the routed experts of every KV-cache slot and answers a request with the rows of positions
``[routed_experts_start_len, seqlen - 1)`` (the last sampled token was never fed forward), so a prefix-cache
hit returns the routes recorded when those positions were computed. This engine does the same: a forward
hook on each ``Qwen3MoeTopKRouter`` (the only place transformers' Qwen3-MoE picks its top-k) catches the
ids of every forward, and the rows live beside the KV cache entry they belong to
(:class:`~rollbus.services.engine.prefix_cache.CacheEntry`). A layer without a router (dense) keeps zeros.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter


class RouteRecorder:
    """Hooks on every router of ``model``; :meth:`take` gives the last forward's rows."""

    def __init__(self, model: PreTrainedModel) -> None:
        layers = getattr(model, model.base_model_prefix).layers
        self.routers = {
            index: layer.mlp.gate
            for index, layer in enumerate(layers)
            if isinstance(getattr(getattr(layer, "mlp", None), "gate", None), Qwen3MoeTopKRouter)
        }
        self.layers = int(model.config.num_hidden_layers)
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0))
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in self.routers.items()]

    @classmethod
    def of(cls, model: PreTrainedModel) -> RouteRecorder | None:
        """A recorder for an MoE model; None for a dense one (requests asking for routes get none)."""
        recorder = cls(model)
        if not recorder.routers:
            recorder.close()
            return None
        return recorder

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
            self._seen[layer] = output[2].detach()  # (tokens, top_k): one unpadded sequence a forward

        return record

    def take(self, tokens: int) -> np.ndarray:
        """The rows of the ``tokens`` positions of the last forward, ``[tokens, layers x top_k]`` int32."""
        rows = np.zeros((tokens, self.layers, self.top_k), np.int32)
        for layer, ids in self._seen.items():
            rows[:, layer] = ids.to(torch.int32).cpu().numpy()
        self._seen.clear()
        return rows.reshape(tokens, self.layers * self.top_k)
