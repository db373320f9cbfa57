"""A KV cache that appends in amortised O(1), for long CPU decodes.

``DynamicLayer`` grows its keys/values with ``torch.cat`` on every forward, copying the whole cache
each decode step: at 16k cached tokens that copy is most of a step's time. :class:`GrowingLayer`
writes into buffers over-allocated by doubling and exposes ``keys``/``values`` as views of the filled
part, so ``crop`` (a shorter view), ``get_seq_length`` and ``copy.deepcopy`` keep working unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with doubling buffers instead of per-step concatenation."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        needed = length + key_states.shape[-2]
        if self.key_buffer is None or self.value_buffer is None or needed > self.key_buffer.shape[-2]:
            if self.keys is None or self.values is None:  # lazy_initialization made both
                raise RuntimeError("a growing layer without its keys and values")
            self.key_buffer = _grown(self.keys, key_states, length, needed)
            self.value_buffer = _grown(self.values, value_states, length, needed)
        self.key_buffer[..., length:needed, :] = key_states
        self.value_buffer[..., length:needed, :] = value_states
        self.keys = self.key_buffer[..., :needed, :]
        self.values = self.value_buffer[..., :needed, :]
        return self.keys, self.values


def _grown(filled: torch.Tensor, like: torch.Tensor, length: int, needed: int) -> torch.Tensor:
    """A buffer of at least twice ``needed`` positions holding the first ``length`` of ``filled``."""
    shape = (*like.shape[:-2], max(2 * needed, 256), like.shape[-1])
    buffer = torch.empty(shape, dtype=like.dtype, device=like.device)
    if length:
        buffer[..., :length, :] = filled[..., :length, :]
    return buffer


def growing_cache(config: PreTrainedConfig) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose layers are :class:`GrowingLayer`."""
    kv = DynamicCache(config=config)
    kv.layers = [GrowingLayer() for _ in kv.layers]
    return kv
