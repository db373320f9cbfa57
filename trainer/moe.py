"""A small random Qwen3-MoE policy (transformers' ``Qwen3MoeForCausalLM``), the MoE twin of the random Qwen3.

Same tokenizer id space, attention shape and seeding as :func:`rollbus.policy_model.random_qwen3`; every
decoder layer is a sparse MoE block of ``experts`` experts, ``top_k`` per token. The auxiliary load-balancing
loss is off (``router_aux_loss_coef = 0``): it chooses its own top-k from the logits, which routing replay
does not force.
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rollbus.policy_model import ModelSpec
from rollbus.trainer.settings import MoeSpec


def qwen3_moe_config(
    spec: ModelSpec, moe: MoeSpec, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        moe_intermediate_size=moe.expert_size, num_experts=moe.experts, num_experts_per_tok=moe.top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.context_length, tie_word_embeddings=True,
        eos_token_id=list(stop_token_ids), architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip


def random_qwen3_moe(
    spec: ModelSpec, moe: MoeSpec, vocab_size: int, stop_token_ids: tuple[int, ...], seed: int
) -> Qwen3MoeForCausalLM:
    """A freshly initialised float32 MoE; the same ``seed`` always gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(qwen3_moe_config(spec, moe, vocab_size, stop_token_ids))
    return model.float()
