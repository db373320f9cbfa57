"""Reuse of attention KV across a conversation's turns (a small, CPU-sized radix cache).

A coding agent resends the whole conversation every turn, so turn *n*'s prompt extends turn *n-1*'s
prompt plus its output. Each entry keeps a ``DynamicCache`` and the token ids whose keys/values it
holds; a request takes the entry sharing the longest prefix with its prompt and only prefills the rest.

* Pure extension (the entry's ids are a prefix of the prompt): the entry is taken over and grown in
  place, no copy.
* Divergence (the prompt leaves the entry part-way, e.g. a re-rendered assistant turn): the entry is
  copied and the copy cropped to the common prefix, so the other branch (another chain sharing the
  system prompt) keeps its cache.

At most ``capacity`` entries are kept, least recently used evicted first. At least one prompt token is
always left to prefill, since the next token's logits come from forwarding it.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np
from transformers import DynamicCache


@dataclass
class CacheEntry:
    """A KV cache and the token ids it holds, position for position; with an MoE that records its routing
    (:mod:`rollbus.services.engine.routes`), the experts chosen at each of those positions."""

    token_ids: np.ndarray
    kv: DynamicCache
    routes: np.ndarray | None = None  # [positions, layers x top_k] int32, or None: not recorded


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def crop(kv: DynamicCache, length: int) -> None:
    """Keep only the first ``length`` positions (``DynamicCache.crop`` takes a negative count)."""
    excess = kv.get_seq_length() - length
    if excess > 0:
        kv.crop(-excess)


class PrefixCache:
    """LRU of :class:`CacheEntry`, looked up by longest shared token prefix."""

    def __init__(self, capacity: int, new_kv: Callable[[], DynamicCache]) -> None:
        if capacity < 0:
            raise ValueError(f"prefix cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._new_kv = new_kv
        self._entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self._keys = count()

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, prompt_ids: Sequence[int]) -> CacheEntry:
        """An entry holding the longest reusable prefix of ``prompt_ids`` (possibly empty).

        The caller owns the entry until :meth:`release`; its ``token_ids`` say how much is cached.
        """
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        reusable = len(prompt) - 1
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            shared = min(common_prefix_length(entry.token_ids, prompt), reusable)
            if shared > best_len:
                best_key, best_len = key, shared
        if best_key is None:
            return CacheEntry(prompt[:0], self._new_kv())
        entry = self._entries[best_key]
        if best_len == len(entry.token_ids):
            del self._entries[best_key]
            return entry
        kv = copy.deepcopy(entry.kv)
        crop(kv, best_len)
        self._entries.move_to_end(best_key)
        routes = None if entry.routes is None else entry.routes[:best_len]
        return CacheEntry(entry.token_ids[:best_len], kv, routes)

    def release(self, entry: CacheEntry) -> None:
        """Keep ``entry`` as the most recent, evicting the least recently used beyond capacity."""
        if self.capacity == 0 or len(entry.token_ids) == 0:
            return
        self._entries[next(self._keys)] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def cached_tokens(self) -> int:
        """Total positions held, for ``/get_server_info``."""
        return sum(len(entry.token_ids) for entry in self._entries.values())
