"""The policy network: a small Qwen3 (random weights by default) or a saved checkpoint.

There are no pretrained weights here, so the default model is a Qwen3-architecture network initialised
from a fixed seed, sized by flags and sharing the Qwen3.6 tokenizer's id space; it is built by
:mod:`rollbus.policy_model`, shared with the trainer. Checkpoints are plain ``save_pretrained`` directories,
the same format the trainer writes and ``/update_weights_from_disk`` reads. Served models use
:mod:`rollbus.services.engine.attention` and grow their KV cache with :mod:`rollbus.services.engine.kv`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3ForCausalLM

from rollbus.policy_model import ModelSpec, random_qwen3
from rollbus.services.engine.attention import use_prefix_attention
from rollbus.services.engine.kv import growing_cache


def random_model(
    spec: ModelSpec, vocab_size: int, stop_token_ids: tuple[int, ...], seed: int
) -> Qwen3ForCausalLM:
    """A freshly initialised model; the same ``seed`` always gives the same weights."""
    model = random_qwen3(spec, vocab_size, stop_token_ids, seed)
    use_prefix_attention(model)
    return model.eval()


def load_model(path: str | Path, min_vocab_size: int) -> Qwen3ForCausalLM:
    """Load a ``save_pretrained`` checkpoint, refusing one whose embedding misses tokenizer ids."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    if model.config.vocab_size < min_vocab_size:
        raise ValueError(
            f"checkpoint {path} has vocab_size {model.config.vocab_size}, "
            f"smaller than the tokenizer's {min_vocab_size} ids"
        )
    use_prefix_attention(model)
    return model.eval()


def new_kv(model: Qwen3ForCausalLM) -> DynamicCache:
    return growing_cache(model.config)


def context_length(model: Qwen3ForCausalLM) -> int:
    return int(model.config.max_position_embeddings)
