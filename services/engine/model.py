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
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from rollbus.policy_model import ModelSpec, MoeSpec, random_qwen3, random_qwen3_moe
from rollbus.services.engine.attention import use_prefix_attention
from rollbus.services.engine.kv import growing_cache


def random_model(
    spec: ModelSpec, vocab_size: int, stop_token_ids: tuple[int, ...], seed: int, moe: MoeSpec | None = None
) -> PreTrainedModel:
    """A freshly initialised model (a Qwen3-MoE with ``moe``); the same ``seed`` always gives the same
    weights, the trainer's version 0."""
    model: PreTrainedModel
    if moe is None:
        model = random_qwen3(spec, vocab_size, stop_token_ids, seed)
    else:
        model = random_qwen3_moe(spec, moe, vocab_size, stop_token_ids, seed)
    use_prefix_attention(model)
    return model.eval()


def load_model(path: str | Path, min_vocab_size: int) -> PreTrainedModel:
    """Load a ``save_pretrained`` checkpoint (Qwen3 or Qwen3-MoE, as ``config.json`` says), refusing one whose
    embedding misses tokenizer ids."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if model.config.vocab_size < min_vocab_size:
        raise ValueError(
            f"checkpoint {path} has vocab_size {model.config.vocab_size}, "
            f"smaller than the tokenizer's {min_vocab_size} ids"
        )
    use_prefix_attention(model)
    return model.eval()


def new_kv(model: PreTrainedModel) -> DynamicCache:
    return growing_cache(model.config)


def context_length(model: PreTrainedModel) -> int:
    return int(model.config.max_position_embeddings)
