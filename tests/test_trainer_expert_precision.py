"""MoE experts in one process under autocast compute in bf16 (``rollbus.trainer.expert_precision``), as
FSDP2's mixed-precision policy makes them, while their weights, gradients and the computation without
autocast stay what they were."""

from __future__ import annotations

import torch

from rollbus.policy_model import ModelSpec
from rollbus.trainer.expert_precision import cast_experts_under_autocast, expert_modules
from rollbus.trainer.moe import MoeSpec, random_qwen3_moe

SPEC = ModelSpec(hidden_size=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate_size=32,
                 context_length=64)  # fmt: skip
IDS = torch.tensor([[5, 17, 3, 44, 9, 61, 2, 33, 80, 14, 7, 21]])


def model(cast: bool) -> torch.nn.Module:
    built = random_qwen3_moe(SPEC, MoeSpec(experts=8, top_k=2, expert_size=32), 97, (0,), seed=3)
    if cast:
        assert cast_experts_under_autocast(built) == SPEC.layers  # one experts module per MoE layer
    return built


def weight_dtypes_seen(built: torch.nn.Module, autocast: bool) -> set[torch.dtype]:
    """The dtypes of the expert weights each experts forward ran with, and a backward through them."""
    seen: set[torch.dtype] = set()
    for experts in expert_modules(built):
        experts.register_forward_pre_hook(lambda m, args: seen.add(m.gate_up_proj.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        built(input_ids=IDS).logits.float().sum().backward()
    return seen


def test_under_autocast_the_experts_compute_with_bf16_weights_only_when_cast() -> None:
    assert weight_dtypes_seen(model(cast=False), autocast=True) == {torch.float32}  # the defect
    assert torch.bfloat16 in weight_dtypes_seen(model(cast=True), autocast=True)


def test_the_cast_keeps_fp32_weights_and_gradients_and_changes_nothing_without_autocast() -> None:
    plain, cast = model(cast=False), model(cast=True)
    weight_dtypes_seen(cast, autocast=True)
    for experts in expert_modules(cast):
        for p in experts.parameters(recurse=False):
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
            assert float(p.grad.abs().sum()) > 0
    with torch.no_grad():
        torch.testing.assert_close(cast(input_ids=IDS).logits, plain(input_ids=IDS).logits, rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            near = cast(input_ids=IDS).logits.float()
    torch.testing.assert_close(near, plain(input_ids=IDS).logits.detach(), rtol=0.05, atol=0.05)
