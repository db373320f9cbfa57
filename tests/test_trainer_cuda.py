"""The trainer on a CUDA device, against the fp32 CPU path the rest of the suite proves.

Every test here needs a GPU and is skipped where none exists (CI has none, so none of these counts there).
On a GPU machine: ``python -m pytest --noconftest -o addopts= -s tests/test_trainer_cuda.py``. ``-s`` shows
the figures each test prints (bf16 drift, mismatch with and without routing replay), which are what a user
compares when a GPU run diverges from a CPU one. With one GPU, FSDP2 runs over NCCL at world size 1: the
sharding code, the mixed-precision policy and NCCL's collectives run, but no parameter is split across cards.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from rollbus.kafka.broker import free_port
from rollbus.trainer.checkpoint import TrainerState
from rollbus.trainer.device import Placement, autocast, placement
from rollbus.trainer.expert_precision import cast_experts_under_autocast
from rollbus.trainer.loss import LossConfig, PolicyForward, SegmentInput
from rollbus.trainer.routing_replay import RoutingReplay
from rollbus.trainer.sharding import shard
from rollbus.trainer.step import OptimConfig, make_optimizer, train_step
from tests.test_trainer_fsdp import batch, build
from tests.test_trainer_routing_replay import near_tied, rollout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LOSS = LossConfig(logits_chunk=3)
OPTIM = OptimConfig(lr=1e-2)


def one_step(kind: str, device: str, precision: str, *, sharded: bool = False):
    """The fsdp test's first step on ``device``: (loss, weight change per parameter name)."""
    model = build(kind)
    segments = batch(model, kind, 0)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    where = placement(device, precision)
    forward = PolicyForward(model.to(where.device), RoutingReplay(model) if kind == "moe" else None)
    if sharded:
        shard(forward, where)
    elif where.mixed:  # as the Learner does in one process
        cast_experts_under_autocast(model)
    optimizer = make_optimizer(forward, OPTIM)
    result = train_step(forward, optimizer, segments, LOSS, OPTIM, where)
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    delta = {k: after[k].detach().float().cpu() - before[k] for k in before}
    return result, delta


def logprobs_on(
    where: Placement, model: torch.nn.Module, ids: list[int], prompt: int, routes: torch.Tensor, replay: bool
) -> tuple[torch.Tensor, bool]:
    """The sampled tokens' log-probabilities as the trainer computes them on ``where``."""
    forward = PolicyForward(model, RoutingReplay(model) if replay else None)
    segment = SegmentInput(torch.tensor(ids), torch.arange(prompt, len(ids)), torch.zeros(len(ids) - prompt),
                           1.0, 1.0, routed_experts=routes)  # fmt: skip
    with torch.no_grad(), autocast(where, sharded=False), forward.routes(segment) as replayed:
        logp, _ = forward(segment.input_ids.to(where.device), segment.positions.to(where.device), 4)
    if forward.replay is not None:
        forward.replay.close()
    return logp, replayed


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def test_auto_places_the_trainer_on_the_gpu_in_bf16() -> None:
    where = placement("auto", "auto")
    assert where.device.type == "cuda" and where.backend == "nccl"
    assert where.compute_dtype == torch.bfloat16 and where.mixed
    print(f"\ncard: {where.name()}, torch {torch.__version__}")


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_a_bf16_gpu_step_follows_the_fp32_cpu_step(kind: str) -> None:
    cpu, cpu_delta = one_step(kind, "cpu", "fp32")
    gpu, gpu_delta = one_step(kind, "cuda", "bf16")
    assert gpu.stats.tokens == cpu.stats.tokens > 0
    assert gpu.loss == pytest.approx(cpu.loss, rel=0.05, abs=1e-3)
    assert gpu.grad_norm == pytest.approx(cpu.grad_norm, rel=0.1)
    trained = [k for k in cpu_delta if "norm" not in k and float(cpu_delta[k].abs().max()) > 0]
    agreement = {k: cosine(gpu_delta[k], cpu_delta[k]) for k in trained}
    worst = min(agreement, key=agreement.get)
    print(f"\n{kind}: loss cpu {cpu.loss:.6f} gpu-bf16 {gpu.loss:.6f}; grad norm {cpu.grad_norm:.5f} vs "
          f"{gpu.grad_norm:.5f}; update cosine min {agreement[worst]:.3f} ({worst})")  # fmt: skip
    assert agreement[worst] > 0.5, agreement  # a wrong or lost update is ~0 or negative
    if kind == "moe":
        assert gpu.stats.replayed == gpu.stats.tokens


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fsdp2_over_nccl_takes_the_unsharded_gpu_step(kind: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        sharded, sharded_delta = one_step(kind, "cuda", "fp32", sharded=True)
    finally:
        dist.destroy_process_group()
    plain, plain_delta = one_step(kind, "cuda", "fp32")
    assert sharded.loss == pytest.approx(plain.loss, rel=1e-4)
    assert sharded.grad_norm == pytest.approx(plain.grad_norm, rel=1e-3)
    for key, change in plain_delta.items():
        torch.testing.assert_close(sharded_delta[key], change, rtol=1e-3, atol=1e-5, msg=key)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_routing_replay_on_the_gpu_removes_the_mismatch_of_near_tied_routing(precision: str) -> None:
    trainer_model, engine = near_tied()
    prompt = [7, 2, 33, 80, 14]
    ids, sampled, routes = rollout(engine, prompt, 32, seed=2)  # the rollout: fp32 on the CPU
    where = placement("cuda", precision)
    trainer_model = trainer_model.to(where.device)
    figures = {}
    for replay in (False, True):
        logp, replayed = logprobs_on(where, trainer_model, ids, len(prompt), routes, replay)
        assert replayed == replay
        figures[replay] = (logp.float().cpu() - sampled).abs()
    print(f"\n{precision} on {where.name()}: |dlogprob| mean/max replay off "
          f"{figures[False].mean():.2e}/{figures[False].max():.2e}, replay on "
          f"{figures[True].mean():.2e}/{figures[True].max():.2e}")  # fmt: skip
    assert float(figures[True].mean()) < float(figures[False].mean())
    if precision == "fp32":
        assert float(figures[True].max()) < 1e-3


def test_a_checkpoint_written_from_gpu_weights_loads_equal(tmp_path: Path) -> None:
    from rollbus.trainer.learner import Learner
    from rollbus.trainer.settings import TrainerSettings

    options = {"checkpoint_dir": tmp_path, "lr": 1e-2, "logits_chunk": 3, "device": "cuda"}
    settings = TrainerSettings.load(options)
    learner = Learner(settings, build("moe"), TrainerState())
    assert next(learner.model.parameters()).device.type == "cuda"
    learner.step([batch(build("moe"), "moe", 0)])
    written = learner.save(keep=2)
    loaded = build("moe").__class__.from_pretrained(written, dtype=torch.float32)
    for name, value in learner.model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value.detach().cpu(), rtol=0, atol=0, msg=name)
