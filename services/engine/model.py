"""The policy network: a small Qwen3 (random weights by default) or a saved checkpoint.

There are no pretrained weights here, so the default model is a Qwen3-architecture network initialised
from a fixed seed, sized by flags and sharing the Qwen3.6 tokenizer's id space. Its embedding covers
every tokenizer id. Checkpoints are plain ``save_pretrained`` directories, the same format the trainer
writes and ``/update_weights_from_disk`` reads. Served models use :mod:`services.engine.attention`
and grow their KV cache with :mod:`services.engine.kv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from services.engine.attention import use_prefix_attention
from services.engine.kv import growing_cache


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


def random_model(
    spec: ModelSpec, vocab_size: int, stop_token_ids: tuple[int, ...], seed: int
) -> Qwen3ForCausalLM:
    """A freshly initialised model; the same ``seed`` always gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qwen3_config(spec, vocab_size, stop_token_ids))
    use_prefix_attention(model)
    return model.float().eval()


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
