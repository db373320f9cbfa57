"""The small random Qwen3-MoE the trainer trains with ``--moe-experts N``: built by
:mod:`rollbus.policy_model`, shared with the engine, which serves the same model for the same seed and
shape."""

from __future__ import annotations

from rollbus.policy_model import MoeSpec, qwen3_moe_config, random_qwen3_moe

__all__ = ["MoeSpec", "qwen3_moe_config", "random_qwen3_moe"]
