"""Rollout routing replay (R3) on a small random Qwen3-MoE, against an independent "rollout" forward.

The rollout side shares nothing with ``rollbus.trainer.routing_replay``: it samples tokens with the plain
transformers model, takes their log-probabilities from the full logits, and records each layer's chosen
experts with a forward hook, returning them as SGLang does (int32 ``[T-1, layers, top_k]``). The trainer side
computes the same tokens' log-probabilities through ``PolicyForward`` with or without replay.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rollbus.policy_model import ModelSpec
from rollbus.trainer.batch import Group, InvalidSegment, segment_inputs, validate
from rollbus.trainer.loss import LossConfig, PolicyForward, SegmentInput, batch_loss
from rollbus.trainer.metrics import mismatch
from rollbus.trainer.moe import MoeSpec, random_qwen3_moe
from rollbus.trainer.routing_replay import MoeShape, RoutingReplay

VOCAB = 89
SPEC = ModelSpec(hidden_size=32, layers=3, heads=2, kv_heads=1, head_dim=16, intermediate_size=32,
                 context_length=512)  # fmt: skip
MOE = MoeSpec(experts=8, top_k=2, expert_size=32)


def moe_model(seed: int = 11) -> torch.nn.Module:
    model = random_qwen3_moe(SPEC, MOE, VOCAB, (0,), seed)
    with torch.no_grad():  # experts that differ a lot, so which expert a token takes matters
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(20)
            layer.mlp.experts.down_proj.mul_(20)
    return model.eval()


def rollout(
    model: torch.nn.Module, prompt: list[int], new: int, seed: int
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Sample ``new`` tokens; their log-probabilities; the routes of positions 0..T-2 (SGLang's rows)."""
    g = torch.Generator().manual_seed(seed)
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(new):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=g))
            ids.append(token)
            logprobs.append(float(logp[token]))
        chosen: list[torch.Tensor] = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
                 for layer in model.model.layers]  # fmt: skip
        model(input_ids=torch.tensor([ids]))
        for hook in hooks:
            hook.remove()
    routes = torch.stack(chosen, 1)[:-1].to(torch.int32)
    return ids, torch.tensor(logprobs, dtype=torch.float32), routes


def trainer_logprobs(
    model: torch.nn.Module, ids: list[int], prompt: int, routes: torch.Tensor | None, replay: bool
):
    forward = PolicyForward(model, RoutingReplay(model) if replay else None)
    segment = SegmentInput(torch.tensor(ids), torch.arange(prompt, len(ids)), torch.zeros(len(ids) - prompt),
                           1.0, 1.0, routed_experts=routes)  # fmt: skip
    with torch.no_grad(), forward.routes(segment) as replayed:
        logp, _ = forward(segment.input_ids, segment.positions, 4)
    if forward.replay is not None:
        forward.replay.close()
    return logp, replayed


def noisy_router_copy(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """The same weights with every router's weight off by rounding-sized noise, as between two engines'
    kernels: enough to flip experts whose logits are nearly tied, too little to matter anywhere else."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in other.model.layers:
            layer.mlp.gate.weight.add_(torch.randn(layer.mlp.gate.weight.shape, generator=g) * scale)
    return other


def test_with_equal_weights_replayed_logprobs_match_the_rollouts() -> None:
    model = moe_model()
    prompt = [5, 17, 3, 44, 9, 61]
    ids, sampled, routes = rollout(model, prompt, 24, seed=1)
    assert routes.shape == (len(ids) - 1, SPEC.layers, MOE.top_k)
    logp, replayed = trainer_logprobs(model, ids, len(prompt), routes, replay=True)
    assert replayed
    torch.testing.assert_close(logp.float(), sampled, rtol=0, atol=2e-5)


def near_tied() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model whose router logits are nearly tied everywhere (router weights ~1e-6), and its engine twin."""
    model = moe_model(seed=12)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(1e-4)
    return model, noisy_router_copy(model, 1e-6, seed=3)


def test_near_tied_routing_mismatches_without_replay_and_matches_with_it() -> None:
    trainer_model, engine = near_tied()
    prompt = [7, 2, 33, 80, 14]
    ids, sampled, routes = rollout(engine, prompt, 32, seed=2)
    own_routes = rollout(trainer_model, prompt, 0, seed=0)[2]  # the trainer's own choice on the prompt
    assert not torch.equal(own_routes, routes[: len(own_routes)]), "the noise must flip some experts"
    off, replayed_off = trainer_logprobs(trainer_model, ids, len(prompt), routes, replay=False)
    on, replayed_on = trainer_logprobs(trainer_model, ids, len(prompt), routes, replay=True)
    assert not replayed_off and replayed_on
    mismatch_off = (off.float() - sampled).abs()
    mismatch_on = (on.float() - sampled).abs()
    assert float(mismatch_off.mean()) > 1e-2, f"replay off: {mismatch_off}"
    assert float(mismatch_on.max()) < 1e-4, f"replay on: {mismatch_on}"


def test_replay_keeps_router_gradients_and_measures_the_mismatch() -> None:
    trainer_model, engine = near_tied()
    prompt = [7, 2, 33, 80, 14]
    ids, sampled, routes = rollout(engine, prompt, 20, seed=4)
    positions = torch.arange(len(prompt), len(ids))
    stats = {}
    for replay in (False, True):
        trainer_model.zero_grad()
        forward = PolicyForward(trainer_model, RoutingReplay(trainer_model) if replay else None)
        segment = SegmentInput(torch.tensor(ids), positions, sampled, 1.0, 0.05, routed_experts=routes)
        _, stats[replay] = batch_loss(forward, [segment], LossConfig(logits_chunk=3))
        for layer in trainer_model.model.layers:  # replayed weights come from the router's own logits
            assert float(layer.mlp.gate.weight.grad.abs().sum()) > 0
        if forward.replay is not None:
            forward.replay.close()
    assert stats[True].replayed == stats[True].tokens == len(positions) and stats[False].replayed == 0
    assert stats[True].abs_diff_max < 1e-4 < stats[False].abs_diff / stats[False].tokens
    assert stats[True].approx_kl < stats[False].approx_kl


def test_the_mismatch_without_replay_is_measured_beside_the_replayed_one() -> None:
    trainer_model, engine = near_tied()
    prompt = [7, 2, 33, 80, 14]
    ids, sampled, routes = rollout(engine, prompt, 20, seed=4)
    forward = PolicyForward(trainer_model, RoutingReplay(trainer_model))
    segment = SegmentInput(torch.tensor(ids), torch.arange(len(prompt), len(ids)), sampled, 1.0, 0.05,
                           routed_experts=routes)  # fmt: skip
    config = LossConfig(logits_chunk=3, mismatch_unreplayed=True)
    _, stats = batch_loss(forward, [segment], config, backward=False)
    row = mismatch(stats)
    assert stats.unreplayed_tokens == stats.tokens == len(ids) - len(prompt)
    assert row["logprob_diff_max"] < 1e-4 and row["unreplayed_logprob_diff_mean"] > 1e-2, row
    assert row["unreplayed_approx_kl"] > stats.approx_kl / stats.tokens
    _, plain = batch_loss(forward, [segment], LossConfig(logits_chunk=3), backward=False)
    assert plain.unreplayed_tokens == 0 and "unreplayed_approx_kl" not in mismatch(plain)


# --------------------------------------------------------------------------- recorded experts as input


def segment_with(routes, prompt=3, response=5) -> dict:
    return {
        "segment_id": "s", "rollout_id": "r", "group_id": "g", "index": 0, "num_segments": 1,
        "prompt_ids": list(range(1, prompt + 1)), "response_ids": list(range(10, 10 + response)),
        "loss_mask": bytes([1] * response), "rollout_logprobs": [-1.0] * response,
        "policy_versions": [0] * response, "trajectory_reward": 1.0, "reward": 1.0, "attempt_id": "",
        "routed_experts": routes,
    }  # fmt: skip


SHAPE = MoeShape(layers=3, top_k=2, experts=8, moe_layers=(0, 1, 2))


def good_routes(rows: int = 7) -> torch.Tensor:
    return torch.tensor(
        [[[(r + i) % 8, (r + i + 1) % 8] for i in range(3)] for r in range(rows)], dtype=torch.uint8
    )


@pytest.mark.parametrize(
    ("routes", "reason"),
    [
        (good_routes()[:, :2], "shape"),
        (good_routes(5), "cover 5 positions"),
        (good_routes().float(), "integers"),
        (
            good_routes().masked_fill(
                torch.zeros(7, 3, 2, dtype=torch.bool).index_fill(0, torch.tensor([4]), True), 8
            ),
            "outside",
        ),
        (good_routes().int() - 9, "outside"),
        (torch.stack([good_routes()[..., 0]] * 2, -1), "repeated"),
        ([[1, 2]], "shape"),
        ("not an array", "segment 's'"),
    ],
)
def test_malformed_routed_experts_are_refused_with_the_reason(routes, reason: str) -> None:
    with pytest.raises(InvalidSegment, match=reason):
        validate(segment_with(routes), vocab_size=VOCAB, moe=SHAPE)


def test_routes_of_every_position_or_all_but_the_last_are_taken_and_a_segment_without_them_is_too() -> None:
    for rows in (7, 8):
        validate(segment_with(good_routes(rows)), vocab_size=VOCAB, moe=SHAPE)
    validate(segment_with(None), vocab_size=VOCAB, moe=SHAPE)  # old events: the trainer routes on its own
    validate(segment_with(good_routes(2)), vocab_size=VOCAB, moe=None)  # a dense model ignores them
    group = Group(
        "g",
        {
            "r": {0: segment_with(good_routes().numpy())},
            "q": {0: {**segment_with(None), "rollout_id": "q", "trajectory_reward": 0.0}},
        },
    )
    inputs = segment_inputs([group], normalize_std=True)
    assert {tuple(i.routed_experts.shape) if i.routed_experts is not None else None for i in inputs} == {
        (7, 3, 2),
        None,
    }
