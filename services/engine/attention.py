"""Attention for a prompt suffix that follows cached tokens, without an attention mask.

With past keys, Transformers builds an explicit (query x key) boolean mask for SDPA, and on CPU SDPA
converts it to an additive mask in every layer: for a 1.6k-token suffix after 15k cached tokens that
costs about as much as the attention itself. For one unpadded sequence the mask is implied: every
query sees all cached keys, and the suffix keys causally. So the suffix is attended in two masks-free
flash calls, over the cached keys (no mask) and over the suffix keys (``is_causal``), merged exactly by
their log-sum-exp. Everything else (prefill from empty, decode) goes to Transformers' own SDPA path.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

NAME = "rollbus_prefix_sdpa"


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float | None):
    """SDPA's CPU flash kernel, which also returns the per-query log-sum-exp of the scores."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return kernel(query, key, value, 0.0, causal, scale=scale)


def suffix_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Causal attention of the last ``query_len`` positions over all keys, shape (batch, heads, q, dim)."""
    past = key.shape[2] - query.shape[2]
    out_past, lse_past = _flash(query, key[:, :, :past], value[:, :, :past], False, scale)
    out_new, lse_new = _flash(query, key[:, :, past:], value[:, :, past:], True, scale)
    top = torch.maximum(lse_past, lse_new)
    weight_past = torch.exp(lse_past - top).unsqueeze(-1)
    weight_new = torch.exp(lse_new - top).unsqueeze(-1)
    return (out_past * weight_past + out_new * weight_new) / (weight_past + weight_new)


def prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None or q_len in (1, kv_len) or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    out = suffix_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), scaling)
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs) -> None:
    """Single unpadded sequences only: causality is applied by :func:`prefix_attention` itself."""
    return None


def use_prefix_attention(model: PreTrainedModel) -> None:
    AttentionInterface.register(NAME, prefix_attention)
    AttentionMaskInterface.register(NAME, no_mask)
    model.set_attn_implementation(NAME)
