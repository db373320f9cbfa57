"""Device and precision choices: what ``auto`` resolves to, refusals, and a bf16 step keeping fp32 state."""

from __future__ import annotations

import pytest
import torch

from rollbus.policy_model import ModelSpec
from rollbus.trainer.device import DeviceError, placement
from rollbus.trainer.loss import LossConfig, PolicyForward, SegmentInput
from rollbus.trainer.moe import MoeSpec, random_qwen3_moe
from rollbus.trainer.routing_replay import RoutingReplay
from rollbus.trainer.step import OptimConfig, make_optimizer, train_step

SPEC = ModelSpec(hidden_size=16, layers=2, heads=2, kv_heads=1, head_dim=8, intermediate_size=32)


def test_auto_is_the_gpu_in_bf16_when_there_is_one_else_the_cpu_in_fp32() -> None:
    where = placement("auto", "auto")
    if torch.cuda.is_available():
        assert where.device.type == "cuda" and where.backend == "nccl"
    else:
        assert (where.device.type, where.compute_dtype, where.backend) == ("cpu", torch.float32, "gloo")
    assert placement("cpu", "bf16").compute_dtype == torch.bfloat16


def test_cuda_without_a_gpu_is_refused_by_name() -> None:
    if torch.cuda.is_available():
        assert placement("cuda", "fp32").device.type == "cuda"
        return
    with pytest.raises(DeviceError, match="no CUDA device"):
        placement("cuda", "auto")


def test_a_bf16_step_on_the_cpu_keeps_parameters_and_adamw_state_in_fp32() -> None:
    steps = {}
    for precision in ("fp32", "bf16"):
        model = random_qwen3_moe(SPEC, MoeSpec(experts=4, top_k=2, expert_size=16), 97, (0,), seed=3)
        forward = PolicyForward(model, RoutingReplay(model))
        optimizer = make_optimizer(forward, OptimConfig(lr=1e-2))
        ids = torch.tensor([3, 9, 27, 81, 50, 12, 7, 64])
        routes = torch.tensor([[[i % 4, (i + 1) % 4]] * 2 for i in range(7)])
        segment = SegmentInput(
            ids, torch.arange(3, 8), torch.full((5,), -4.5), 1.0, 0.2, routed_experts=routes
        )
        where = placement("cpu", precision)
        steps[precision] = train_step(
            forward, optimizer, [segment], LossConfig(logits_chunk=2), OptimConfig(), where
        )
        assert all(p.dtype == torch.float32 for p in model.parameters())
        state = optimizer.state_dict()["state"]
        assert state and all(s["exp_avg"].dtype == torch.float32 for s in state.values())
        assert steps[precision].stats.replayed == 5
    assert steps["bf16"].loss != steps["fp32"].loss, "bf16 must have computed something in bf16"
    assert steps["bf16"].loss == pytest.approx(steps["fp32"].loss, rel=0.05)
