"""The policy network's shape and construction, shared by the engine (which serves it) and the trainer.

There are no pretrained weights here, so the default policy is a Qwen3-architecture network initialised from a
fixed seed, sized by a :class:`ModelSpec` and sharing the Qwen3.6 tokenizer's id space (its embedding covers
every tokenizer id). Both sides build it through :func:`random_qwen3`, so the trainer's version 0 is exactly
the engine's random model, and a real checkpoint (``save_pretrained`` layout) drops in for either.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from rollbus.settings import Settings

if TYPE_CHECKING:  # torch and transformers load when a model is built, not with the settings (--help)
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

DEFAULT_TOKENIZER = "qwen3.6"  # the built-in tokenizer (rollbus.tokenizer builds it)


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


@dataclass(frozen=True)
class MoeSpec:
    """The experts of the small random Qwen3-MoE (:func:`random_qwen3_moe`), the random Qwen3's MoE twin."""

    experts: int = 8
    top_k: int = 2
    expert_size: int = 32  # each expert's intermediate width


class ModelSettings(Settings):
    """The policy's options, declared once for the engine and the trainer, whose random version 0 must agree
    (same tokenizer, seed and shape) unless both load ``--model-path``."""

    model_path: Path | None = Field(None, description="save_pretrained checkpoint dir (else random weights)")
    tokenizer: str = Field(DEFAULT_TOKENIZER, min_length=1, description="tokenizer name or directory")
    seed: int = Field(0, ge=0, description="seed of the random weights (the engine also samples with it)")
    hidden_size: int = Field(ModelSpec.hidden_size, ge=1, description="random model width")
    layers: int = Field(ModelSpec.layers, ge=1, description="random model depth")
    heads: int = Field(ModelSpec.heads, ge=1, description="attention heads")
    kv_heads: int = Field(ModelSpec.kv_heads, ge=1, description="key/value heads")
    head_dim: int = Field(ModelSpec.head_dim, ge=1, description="attention head size")
    intermediate_size: int = Field(ModelSpec.intermediate_size, ge=1, description="MLP width")
    context_length: int = Field(ModelSpec.context_length, ge=2, description="max tokens")
    moe_experts: int = Field(
        0, ge=0, description="random model: a Qwen3-MoE with this many experts per layer; 0: dense Qwen3"
    )
    moe_top_k: int = Field(MoeSpec.top_k, ge=1, description="random MoE: experts chosen per token")
    moe_expert_size: int = Field(MoeSpec.expert_size, ge=1, description="random MoE: each expert's width")

    def moe_spec(self) -> MoeSpec | None:
        """The random model's experts; None for the dense Qwen3."""
        if not self.moe_experts:
            return None
        return MoeSpec(experts=self.moe_experts, top_k=self.moe_top_k, expert_size=self.moe_expert_size)

    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            hidden_size=self.hidden_size, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size,
            context_length=self.context_length,
        )  # fmt: skip


def qwen3_config(spec: ModelSpec, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Qwen3Config:
    from transformers import Qwen3Config

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
    import torch
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qwen3_config(spec, vocab_size, stop_token_ids))
    return model.float()


def qwen3_moe_config(
    spec: ModelSpec, moe: MoeSpec, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> Qwen3MoeConfig:
    """Every decoder layer a sparse MoE block; the auxiliary load-balancing loss off
    (``router_aux_loss_coef = 0``): it chooses its own top-k from the logits, which routing replay does not
    force."""
    from transformers import Qwen3MoeConfig

    # head_dim goes through the config's **kwargs (it is set), which transformers' typed signature leaves out
    return Qwen3MoeConfig(  # type: ignore[call-arg]
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
    """A freshly initialised float32 Qwen3-MoE with :func:`random_qwen3`'s tokenizer space, attention shape
    and seeding; the same ``seed`` always gives the same weights."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(qwen3_moe_config(spec, moe, vocab_size, stop_token_ids))
    return model.float()
