"""The trainer's loss and gradient against a deliberately naive, separate computation.

The naive side shares nothing with ``rollbus.trainer.loss`` / ``rollbus.trainer.batch`` /
``rollbus.trainer.advantages``: it runs the full model on each segment, takes every trained token's
log-probability from the full-vocabulary logits one token at a time, computes group advantages, ratios,
clipping, importance weights and the per-rollout-mean reducer with plain Python over tokens. Both sides run a
tiny float64 Qwen3 on the same fixed batch (several segments per rollout, masked tool-result tokens, rollout
log-probabilities perturbed so both clip edges are hit), and loss and every parameter's gradient must agree to
1e-9 relative.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from rollbus.policy_model import ModelSpec, random_qwen3
from rollbus.trainer.batch import Group, segment_inputs
from rollbus.trainer.loss import LossConfig, PolicyForward, batch_loss, shared_prefixes

VOCAB = 61
SPEC = ModelSpec(hidden_size=16, layers=2, heads=2, kv_heads=1, head_dim=8, intermediate_size=32,
                 context_length=256)  # fmt: skip


def tiny_model(seed: int = 3) -> torch.nn.Module:
    return random_qwen3(SPEC, VOCAB, (0,), seed).double()


def fixed_groups(model: torch.nn.Module) -> list[Group]:
    """Two groups of three rollouts, 1-3 segments each; rollout logprobs = the model's own + noise."""
    rng = random.Random(7)
    groups = []
    for g in range(2):
        group = Group(f"g{g}")
        for r in range(3):
            k = rng.randint(1, 3)
            reward = rng.choice([0.0, 1.0, 0.5, 2.0])
            group.rollouts[f"g{g}-r{r}"] = {
                i: fake_segment(model, rng, f"g{g}", f"g{g}-r{r}", i, k, reward) for i in range(k)
            }
        groups.append(group)
    return groups


def fake_segment(model, rng, group_id, rollout_id, index, k, reward) -> dict:
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))]
    response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 14))]
    mask = bytes(rng.choice([1, 1, 0]) for _ in response)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    own = torch.log_softmax(logits, -1)
    logprobs = []
    for j, tok in enumerate(response):
        lp = float(own[len(prompt) + j - 1, tok]) + rng.gauss(0.0, 0.4)
        logprobs.append(float(torch.tensor(min(lp, 0.0), dtype=torch.float32)))  # avro floats are 32-bit
    return {
        "segment_id": f"{rollout_id}-{index}", "rollout_id": rollout_id, "group_id": group_id,
        "index": index, "num_segments": k, "prompt_ids": prompt, "response_ids": response, "loss_mask": mask,
        "rollout_logprobs": logprobs, "trajectory_reward": reward,
        "policy_versions": [(index + j) % 4 for j in range(len(response))],  # a partial rollout: 0..3
        "attempt_id": "", "reward": reward / k,
    }  # fmt: skip


# ------------------------------------------------------------------ the naive side


def naive_advantages(rewards: list[float], normalize_std: bool) -> list[float]:
    mean = 0.0
    for r in rewards:
        mean += r / len(rewards)
    var = 0.0
    for r in rewards:
        var += (r - mean) ** 2 / len(rewards)
    if all(r == rewards[0] for r in rewards):
        return [0.0 for _ in rewards]
    return [(r - mean) / ((math.sqrt(var) + 1e-6) if normalize_std else 1.0) for r in rewards]


def naive_token_logprobs(model, segment) -> list[tuple[torch.Tensor, float]]:
    ids = list(segment["prompt_ids"]) + list(segment["response_ids"])
    logits = model(input_ids=torch.tensor([ids])).logits[0]
    out = []
    for j, m in enumerate(segment["loss_mask"]):
        if m:
            pos = len(segment["prompt_ids"]) + j
            row = logits[pos - 1]
            out.append((row[ids[pos]] - torch.logsumexp(row, 0), segment["rollout_logprobs"][j]))
    return out


def naive_loss(model, groups: list[Group], config: LossConfig, normalize_std: bool) -> torch.Tensor:
    n_rollouts = 0
    for group in groups:
        n_rollouts += len(group.rollouts)
    lo, hi = 1 - config.eps_clip_low, 1 + config.eps_clip_high
    total = torch.zeros((), dtype=torch.float64)
    for group in groups:
        ids = sorted(group.rollouts)
        rewards = [group.rollouts[r][0]["trajectory_reward"] for r in ids]
        for rollout_id, adv in zip(ids, naive_advantages(rewards, normalize_std), strict=True):
            segments = [group.rollouts[rollout_id][i] for i in sorted(group.rollouts[rollout_id])]
            mask_total = 0
            for s in segments:
                for m in s["loss_mask"]:
                    mask_total += m
            for s in segments:
                tokens = naive_token_logprobs(model, s)
                olds = [lp.detach() if config.tis_clip else torch.tensor(rl, dtype=torch.float64)
                        for lp, rl in tokens]  # fmt: skip
                seq_log_ratio = None
                if config.policy_loss == "gspo" and tokens:
                    seq_log_ratio = sum(lp - old for (lp, _), old in zip(tokens, olds, strict=True)) / len(
                        tokens
                    )
                versions = [v for v, m in zip(s["policy_versions"], s["loss_mask"], strict=True) if m]
                for (lp, rollout_lp), old, version in zip(tokens, olds, versions, strict=True):
                    if config.max_version_gap is not None and VERSION - version > config.max_version_gap:
                        continue
                    if config.icepop is not None and not (
                        config.icepop[0] <= math.exp(lp.item() - rollout_lp) <= config.icepop[1]
                    ):
                        continue
                    ratio = torch.exp(seq_log_ratio if seq_log_ratio is not None else lp - old)
                    if ratio.item() < lo:
                        clipped = torch.tensor(lo, dtype=torch.float64)
                    elif ratio.item() > hi:
                        clipped = torch.tensor(hi, dtype=torch.float64)
                    else:
                        clipped = ratio
                    a, b = ratio * adv, clipped * adv
                    chosen = a if a.item() <= b.item() else b
                    weight = 1.0
                    if config.tis_clip:
                        weight = min(math.exp(lp.item() - rollout_lp), config.tis_clip)
                    total = total + (-chosen * weight) / (mask_total * n_rollouts)
    return total


# ------------------------------------------------------------------ the comparison

CONFIGS = {
    "ppo-clip": LossConfig(policy_loss="ppo", logits_chunk=3),
    "ppo-full-logits": LossConfig(policy_loss="ppo", logits_chunk=0),
    "gspo": LossConfig(policy_loss="gspo", eps_clip_low=0.05, eps_clip_high=0.08, logits_chunk=4),
    "tis": LossConfig(policy_loss="ppo", tis_clip=1.5, logits_chunk=5),
    "gspo-tis": LossConfig(policy_loss="gspo", tis_clip=2.0, logits_chunk=2),
    "version-gap": LossConfig(policy_loss="ppo", logits_chunk=3, max_version_gap=1),
    "version-gap-icepop-tis": LossConfig(tis_clip=1.5, logits_chunk=4, max_version_gap=2, icepop=(0.5, 2.0)),
}
VERSION = 3  # the policy the step trains from: tokens of versions 0..3 are 3..0 versions stale


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("normalize_std", [True, False])
def test_loss_and_gradient_match_the_naive_computation(name: str, normalize_std: bool) -> None:
    config = CONFIGS[name]
    model = tiny_model()
    groups = fixed_groups(model)
    assert any(len(r) > 1 for g in groups for r in g.rollouts.values()), "several segments per rollout"

    model.zero_grad()
    inputs = segment_inputs(groups, normalize_std=normalize_std, version=VERSION)
    for s in inputs:
        s.rollout_logprobs = s.rollout_logprobs.double()
    loss, stats = batch_loss(PolicyForward(model), inputs, config)
    ours = grads(model)

    model.zero_grad()
    naive = naive_loss(model, groups, config, normalize_std)
    naive.backward()
    theirs = grads(model)

    assert loss == pytest.approx(float(naive.detach()), rel=1e-9, abs=1e-12)
    assert ours.keys() == theirs.keys() and ours
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-9, atol=1e-12, msg=key)
    assert stats.tokens == sum(sum(s["loss_mask"]) for g in groups for s in g.segments())
    segments = [s for g in groups for s in g.segments()]
    trained = [(v, lp.item() - rl) for s in segments for v, (lp, rl) in zip(
        [v for v, m in zip(s["policy_versions"], s["loss_mask"], strict=True) if m],
        naive_token_logprobs(model, s), strict=True)]  # fmt: skip
    gap = config.max_version_gap
    expected_gap = sum(VERSION - v > gap for v, _ in trained) if gap is not None else 0
    band = config.icepop
    expected_icepop = sum(
        (gap is None or VERSION - v <= gap) and not band[0] <= math.exp(d) <= band[1] for v, d in trained
    ) if band is not None else 0  # fmt: skip
    assert (stats.version_gap_masked, stats.icepop_masked) == (expected_gap, expected_icepop)
    if gap is not None or band is not None:
        assert 0 < stats.version_gap_masked + stats.icepop_masked < stats.tokens, "some masked, not all"
    if config.tis_clip is None:
        assert 0 < stats.clipped < stats.tokens, "the batch must exercise clipping, not just the identity"
    else:
        assert stats.is_weight != stats.tokens, "importance weights must differ from 1 somewhere"
    assert any(float(t.abs().max()) > 0 for t in ours.values())
    segments = [s for g in groups for s in g.segments()]
    diffs = [lp.item() - rl for s in segments for lp, rl in naive_token_logprobs(model, s)]
    assert stats.abs_diff == pytest.approx(sum(abs(d) for d in diffs), rel=1e-9)
    assert stats.abs_diff_max == pytest.approx(max(abs(d) for d in diffs), rel=1e-9)
    assert stats.approx_kl == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs), rel=1e-9)
    outside = sum(not 0.5 <= math.exp(d) <= 2.0 for d in diffs)
    assert stats.ratio_outside == outside and 0 < outside < len(diffs), "the noise must put some outside"


# ------------------------------------------------------------------ a prefix shared by a group's segments


def shared_prompt_groups(model: torch.nn.Module) -> list[Group]:
    """fixed_groups' shape, but every segment of a group starts with the group's long prompt (a harness's
    system prompt and the task), as a group's rollouts do, then a short prompt tail of its own."""
    rng = random.Random(11)
    groups = fixed_groups(model)
    for group in groups:
        shared = [rng.randrange(1, VOCAB) for _ in range(20)]
        for segments in group.rollouts.values():
            for segment in segments.values():
                segment["prompt_ids"] = shared + segment["prompt_ids"]
                ids = torch.tensor([segment["prompt_ids"] + segment["response_ids"]])
                with torch.no_grad():
                    own = torch.log_softmax(model(input_ids=ids).logits[0], -1)
                start = len(segment["prompt_ids"])
                segment["rollout_logprobs"] = [  # avro floats are 32-bit
                    float(torch.tensor(min(float(own[start + j - 1, t]) + rng.gauss(0.0, 0.4), 0.0)))
                    for j, t in enumerate(segment["response_ids"])
                ]
    return groups


def embedded_tokens(model: torch.nn.Module) -> list[int]:
    """Tokens the decoder embeds, call by call (a hook on the embedding)."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    return seen


@pytest.mark.parametrize("name", ["ppo-clip", "ppo-full-logits"])  # the two ways token_logprobs runs
def test_a_shared_prefix_runs_once_and_the_gradient_is_the_naive_one(name: str) -> None:
    config = dataclasses.replace(CONFIGS[name], shared_prefix_min=8)
    model = tiny_model()
    groups = shared_prompt_groups(model)
    inputs = segment_inputs(groups, normalize_std=True)
    for s in inputs:
        s.rollout_logprobs = s.rollout_logprobs.double()
    seen = embedded_tokens(model)
    model.zero_grad()
    loss, stats = batch_loss(PolicyForward(model), inputs, config)
    ours = grads(model)
    whole = sum(len(s.input_ids) for s in inputs)
    assert sum(seen) <= whole - 20 * (len(inputs) - len(groups)), "each group's prompt must run once"

    model.zero_grad()
    naive = naive_loss(model, groups, config, normalize_std=True)
    naive.backward()
    theirs = grads(model)
    # Qwen3's RMSNorms compute in float32, so the prefix's shorter matmuls (other float64 roundings) can
    # round a norm differently: agreement to float32's precision, not float64's
    assert loss == pytest.approx(float(naive.detach()), rel=1e-7, abs=1e-12)
    assert ours.keys() == theirs.keys() and ours
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-8, msg=key)
    assert stats.tokens == sum(sum(s["loss_mask"]) for g in groups for s in g.segments())


def test_shared_prefix_min_0_runs_every_segment_whole() -> None:
    model = tiny_model()
    inputs = segment_inputs(shared_prompt_groups(model), normalize_std=True)
    seen = embedded_tokens(model)
    batch_loss(PolicyForward(model), inputs, LossConfig(shared_prefix_min=0), backward=False)
    assert seen == [len(s.input_ids) for s in inputs]


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens)


def test_shared_prefixes_bundles_neighbours_while_it_saves_attention() -> None:
    # two groups of two: each pair shares 8 tokens, all four only the first 2 (the demo's shape)
    a, b = [1, 2, 3, 3, 3, 3, 3, 3], [1, 2, 4, 4, 4, 4, 4, 4]
    inputs = [ids(*a, 9, 9), ids(*b, 7, 7), ids(*a, 8, 8), ids(*b, 6, 6)]
    assert shared_prefixes(inputs, [9] * 4, minimum=2) == [(8, [0, 2]), (8, [1, 3])]
    # the prefix ends before the hidden state the head reads at the first trained position
    assert shared_prefixes(inputs, [9, 9, 5, 9], minimum=2) == [(4, [0, 2]), (8, [1, 3])]
    # too short a prefix, or nothing shared: each runs whole
    assert shared_prefixes(inputs, [9] * 4, minimum=9) == [(0, [0]), (0, [1]), (0, [2]), (0, [3])]
    assert shared_prefixes([ids(1, 2), ids(2, 1)], [1, 1], minimum=1) == [(0, [0]), (0, [1])]
    # identical inputs: one bundle, the prefix stopping before the first trained position
    assert shared_prefixes([ids(5, 5, 5, 5)] * 3, [3, 3, 3], minimum=1) == [(2, [0, 1, 2])]


def test_shared_prefixes_cover_every_segment_once_within_their_bounds() -> None:
    rng = random.Random(5)
    for _ in range(300):
        stems = [[rng.randrange(3) for _ in range(rng.randint(0, 6))] for _ in range(3)]
        inputs = [ids(*rng.choice(stems), *[rng.randrange(3) for _ in range(rng.randint(1, 5))])
                  for _ in range(rng.randint(1, 6))]  # fmt: skip
        firsts = [rng.randint(1, len(t)) for t in inputs]
        minimum = rng.randint(1, 4)
        bundles = shared_prefixes(inputs, firsts, minimum)
        assert sorted(i for _, members in bundles for i in members) == list(range(len(inputs)))
        for length, members in bundles:
            if len(members) == 1:
                assert length == 0
                continue
            assert length >= minimum
            for i in members:
                assert length <= firsts[i] - 1
                assert inputs[i][:length].tolist() == inputs[members[0]][:length].tolist()
