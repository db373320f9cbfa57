"""The policy network's shape and construction, shared by the engine (which serves it) and the trainer.

There are no pretrained weights here, so the default policy is a Qwen3-architecture network initialised from a
fixed seed, sized by a :class:`ModelSpec` and sharing the Qwen3.6 tokenizer's id space (its embedding covers
every tokenizer id). Both sides build it through :func:`random_qwen3`, so the trainer's version 0 is exactly
the engine's random model, and a real checkpoint (``save_pretrained`` layout) drops in for either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a randomly initialised Qwen3; the defaults make a ~16M-parameter CPU model."""

    hidden_size: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    context_length: int = 131072


def qwen3_config(spec: ModelSpec, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length,
        tie_word_embeddings=True,
        eos_token_id=list(stop_token_ids),
        architectures=["Qwen3ForCausalLM"],
    )


def random_qwen3(
    spec: ModelSpec, vocab_size: int, stop_token_ids: tuple[int, ...], seed: int
) -> Qwen3ForCausalLM:
    """A freshly initialised float32 model; the same ``seed`` always gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qwen3_config(spec, vocab_size, stop_token_ids))
    return model.float()
