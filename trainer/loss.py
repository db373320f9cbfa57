"""The policy-gradient loss over segments: token log-probabilities, clipped ratios, the per-rollout reducer.

Only loss-mask-1 tokens are trained, so only their log-probabilities are computed: the decoder runs once over
the whole segment, then the LM head and the log-softmax run at the masked positions only, a chunk at a time,
each chunk under activation checkpointing so its (chunk x vocabulary) logits are freed after the forward and
recomputed in the backward. A 248k-token vocabulary at 20k positions would otherwise need ~20 GB.

Ratios are taken against the rollout log-probabilities (the sampling policy is the old policy), clipped
PPO-style with separate low/high epsilon; ``gspo`` replaces each token's ratio by its segment's sequence
ratio (the geometric mean over masked tokens); ``tis_clip`` takes the ratio against the trainer's own
log-probabilities instead and multiplies each token by the truncated importance weight
min(pi_trainer / pi_rollout, C). Two masks keep tokens out of the loss, each counted: ``max_version_gap`` (a
partial rollout's tokens sampled more than N versions before the step's policy) and ``icepop`` (tokens whose
ratio pi_trainer / pi_rollout leaves a band, as IcePop does).

Segments that start alike (a group's rollouts share the harness's system prompt and the task, often most of
their tokens) run that shared prefix through the decoder once: its keys and values become the cache each
segment's remainder attends to, and their gradients, summed over the segments, flow back through the prefix
in one backward. Attention over a long prompt is most of a step's cost, so a group of n rollouts costs about
one prompt instead of n. The loss and gradients are those of the separate computation (the prefix's keys and
values are the same numbers either way); one process only, without routing replay or activation
checkpointing (each would need the prefix split through its own state).

The reducer: a segment's summed token loss is divided by the mask total of *all* segments of its rollout, and
by the number of rollouts in the step, so each trajectory counts once however many segments it was cut into.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel

if TYPE_CHECKING:
    from rollbus.trainer.routing_replay import RoutingReplay

PolicyLoss = Literal["ppo", "gspo"]


@dataclass(frozen=True)
class LossConfig:
    policy_loss: PolicyLoss = "ppo"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    tis_clip: float | None = None  # None: ratios against the rollout policy, no TIS
    logits_chunk: int = 512  # masked positions per LM-head chunk (~2 x 512 x vocab floats); 0: full logits
    mismatch_unreplayed: bool = False  # MoE with replay: one more forward per segment, on its own routing
    max_version_gap: int | None = None  # mask tokens sampled over N versions before the step's; None: off
    icepop: tuple[float, float] | None = None  # mask tokens whose pi_trainer / pi_rollout leaves [low, high]
    shared_prefix_min: int = 256  # segments sharing at least this many leading tokens run them once; 0: never


@dataclass
class SegmentInput:
    """What the loss needs of one segment: tokens, the trained positions and their rollout log-probabilities.

    ``positions`` index ``input_ids`` (prompt then response) at the loss-mask-1 tokens; each is predicted
    from the hidden state one position earlier, so every position is at least 1.
    """

    input_ids: torch.Tensor  # (T,) long
    positions: torch.Tensor  # (M,) long
    rollout_logprobs: torch.Tensor  # (M,) float
    advantage: float
    weight: float  # 1 / (mask total of the rollout's segments x rollouts in the step)
    # the experts the rollout's MoE layers chose, [positions, layers, top_k], positions 0..T-2 (or 0..T-1);
    # None: a dense model, or a rollout that did not record them (the trainer routes on its own)
    routed_experts: torch.Tensor | None = None
    filler: bool = False  # an empty pass keeping a rank in step with the others under FSDP2; trains nothing
    # versions between the step's policy and the one that sampled each trained token, (M,); None: unknown
    staleness: torch.Tensor | None = None


@dataclass
class LossStats:
    """Sums over trained tokens, to be divided by ``tokens`` (and all-reduced across ranks) for reporting."""

    tokens: float = 0.0
    clipped: float = 0.0
    approx_kl: float = 0.0
    entropy: float = 0.0
    is_weight: float = 0.0
    # rollout-vs-trainer mismatch: sum of |logprob_trainer - logprob_rollout|, tokens whose importance ratio
    # pi_trainer / pi_rollout leaves [0.5, 2], tokens trained on the rollout's replayed routing
    abs_diff: float = 0.0
    ratio_outside: float = 0.0
    replayed: float = 0.0
    # positions of replayed segments (prompt included) with a recorded route, and those of them whose recorded
    # experts the trainer's own routers chose too in every MoE layer
    route_positions: float = 0.0
    routes_agreed: float = 0.0
    # the same over the replayed tokens, had the trainer routed on its own (LossConfig.mismatch_unreplayed)
    unreplayed_tokens: float = 0.0
    unreplayed_abs_diff: float = 0.0
    unreplayed_approx_kl: float = 0.0
    unreplayed_ratio_outside: float = 0.0
    # tokens kept out of the loss by cause: sampled too many versions ago (max_version_gap), ratio outside the
    # IcePop band (counted only among those the gap kept)
    version_gap_masked: float = 0.0
    icepop_masked: float = 0.0
    abs_diff_max: float = 0.0  # maxima, not sums: reduced with max across segments and ranks
    unreplayed_abs_diff_max: float = 0.0

    def add(self, other: LossStats) -> None:
        for f in fields(self):
            combine = max if f.name in MAX_FIELDS else float.__add__
            setattr(self, f.name, combine(float(getattr(self, f.name)), float(getattr(other, f.name))))

    def sums(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self) if f.name not in MAX_FIELDS]

    def maxes(self) -> list[float]:
        return [getattr(self, name) for name in MAX_FIELDS]

    @classmethod
    def from_lists(cls, sums: list[float], maxes: list[float]) -> LossStats:
        names = [f.name for f in fields(cls) if f.name not in MAX_FIELDS]
        return cls(**dict(zip(names, sums, strict=True)), **dict(zip(MAX_FIELDS, maxes, strict=True)))


MAX_FIELDS = ("abs_diff_max", "unreplayed_abs_diff_max")
RATIO_BAND = (0.5, 2.0)  # an importance ratio outside this counts towards ratio_outside


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    """The causal LM's trunk (``model.model`` for Qwen3): hidden states without the LM head."""
    return getattr(model, model.base_model_prefix)


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def _pick(logp_all: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probabilities and (detached) entropies from a log-softmax.

    The logits are never held here (callers pass the log-softmax straight from the head), so at most two
    (positions x vocabulary) buffers are alive: the log-softmax, kept for its backward, and one scratch
    buffer for the entropy, computed in place without autograd.
    """
    with torch.no_grad():
        scratch = logp_all.exp()
        entropy = -scratch.mul_(logp_all).sum(-1)
        del scratch
    return logp_all.gather(-1, targets[:, None])[:, 0], entropy


def _chunk_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _pick(torch.log_softmax(_upcast(head(hidden)), -1), targets)


def token_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    chunk: int,
    prefix: SharedPrefix | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability (with grad) and entropy (without) of ``input_ids[positions]`` under ``model``; with
    ``prefix`` (which ``input_ids`` starts with) only the tokens after it run, attending to its cache."""
    targets = input_ids[positions]
    start = prefix.length if prefix is not None else 0
    rest: dict[str, Any] = {"input_ids": input_ids[None, start:]}
    if prefix is not None:
        rest.update(past_key_values=prefix.cache(model.config), use_cache=True)
    if chunk <= 0:
        logits = model(**rest).logits[0, positions - 1 - start]
        return _pick(torch.log_softmax(_upcast(logits), -1), targets)
    hidden = decoder_of(model)(**rest).last_hidden_state[0, positions - 1 - start]
    head = model.get_output_embeddings()
    parts = [
        checkpoint(_chunk_logprobs, head, hidden[s : s + chunk], targets[s : s + chunk], use_reentrant=False)
        for s in range(0, len(positions), chunk)
    ]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


class SharedPrefix:
    """The decoder's keys and values over a prefix several segments share, run once.

    Each segment attends to copies of detached leaves of them, so its backward stops at the leaves and adds
    its share to their gradients; :meth:`backward` then takes the summed gradients through the prefix's own
    graph once.
    """

    def __init__(self, model: PreTrainedModel, input_ids: torch.Tensor) -> None:
        self.length = len(input_ids)
        kv = decoder_of(model)(input_ids=input_ids[None], use_cache=True).past_key_values
        self.outputs = [t for layer in kv.layers for t in (layer.keys, layer.values)]
        self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in self.outputs]

    def cache(self, config: PreTrainedConfig) -> DynamicCache:
        cache = DynamicCache(config=config)
        for layer in range(len(self.leaves) // 2):
            cache.update(self.leaves[2 * layer], self.leaves[2 * layer + 1], layer)
        return cache

    def backward(self) -> None:
        pairs = [(out, leaf.grad) for out, leaf in zip(self.outputs, self.leaves, strict=True)
                 if leaf.grad is not None]  # fmt: skip
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


def shared_prefixes(
    inputs: Sequence[torch.Tensor], firsts: Sequence[int], minimum: int
) -> list[tuple[int, list[int]]]:
    """Bundles of segments that run a shared prefix once: ``(prefix length, member indices)``, each index in
    one bundle.

    ``inputs[i]`` is segment i's tokens, ``firsts[i]`` its first trained position (the head reads the hidden
    state before it, so a prefix ends at or before ``firsts[i] - 1``). Segments are taken in token order, so
    those sharing most are neighbours; a neighbour joins the open bundle while that saves at least as much
    attention (n members x prefix length squared, minus the one run) as the bundle saved without it, and the
    prefix stays at least ``minimum`` tokens. A bundle of one has length 0: it runs whole.
    """
    order = sorted(range(len(inputs)), key=lambda i: inputs[i].tolist())
    bundles: list[tuple[int, list[int]]] = []
    length = 0
    members: list[int] = []
    for i in order:
        cap = firsts[i] - 1
        if members:
            joined = min(length, cap, _common(inputs[members[0]], inputs[i]))
            before = (len(members) - 1) * length**2 if len(members) > 1 else 0
            if joined >= max(minimum, 1) and len(members) * joined**2 >= before:
                length, members = joined, [*members, i]
                continue
            bundles.append((length if len(members) > 1 else 0, members))
        length, members = cap, [i]
    if members:
        bundles.append((length if len(members) > 1 else 0, members))
    return sorted(((n, sorted(m)) for n, m in bundles), key=lambda bundle: bundle[1][0])


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    differ = torch.nonzero(a[:n] != b[:n])
    return int(differ[0, 0]) if len(differ) else n


@torch.no_grad()
def mismatch_sums(logp: torch.Tensor, rollout_logprobs: torch.Tensor) -> tuple[float, float, float, float]:
    """Sum and max of |logp - rollout|, the summed k3 estimate of KL(rollout || trainer) from the rollout's
    samples (r - 1 - log r, r = pi_trainer / pi_rollout), and how many ratios r leave ``RATIO_BAND``."""
    diff = logp.detach() - rollout_logprobs.to(logp.dtype)
    ratio = torch.exp(diff)
    low, high = RATIO_BAND
    return (
        float(diff.abs().sum()),
        float(diff.abs().max()) if len(diff) else 0.0,
        float(((ratio - 1) - diff).sum()),
        float(((ratio < low) | (ratio > high)).sum()),
    )


@torch.no_grad()
def kept_tokens(
    logp: torch.Tensor, rollout_logprobs: torch.Tensor, staleness: torch.Tensor | None, config: LossConfig
) -> tuple[torch.Tensor, float, float]:
    """Which trained tokens stay in the loss, and how many each mask took out: the version-gap mask (sampled
    more than ``max_version_gap`` versions before the step's policy), then IcePop (the ratio pi_trainer /
    pi_rollout outside ``icepop``'s band). A masked token adds neither loss nor gradient; the reducer's
    weights are unchanged (a trajectory still counts once)."""
    keep = torch.ones_like(logp, dtype=torch.bool)
    gap_masked = icepop_masked = 0.0
    if config.max_version_gap is not None and staleness is not None:
        keep &= staleness.to(logp.device) <= config.max_version_gap
        gap_masked = float((~keep).sum())
    if config.icepop is not None:
        low, high = config.icepop
        ratio = torch.exp(logp.detach() - rollout_logprobs)
        inside = (ratio >= low) & (ratio <= high)
        icepop_masked = float((keep & ~inside).sum())
        keep &= inside
    return keep, gap_masked, icepop_masked


def segment_loss(
    logp: torch.Tensor, rollout_logprobs: torch.Tensor, advantage: float, weight: float, config: LossConfig,
    staleness: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The segment's weighted summed token loss (a scalar with grad) and its token statistics."""
    rollout_logprobs = rollout_logprobs.to(logp.dtype)
    if config.tis_clip is None:
        old, is_weight = rollout_logprobs, torch.ones_like(logp)
    else:
        old = logp.detach()
        is_weight = torch.exp(old - rollout_logprobs).clamp(max=config.tis_clip)
    masking = config.max_version_gap is not None or config.icepop is not None
    keep, gap_masked, icepop_masked = kept_tokens(logp, rollout_logprobs, staleness, config)
    log_ratio = logp - old
    if config.policy_loss == "gspo":
        kept = keep.sum().clamp(min=1) if masking else len(log_ratio)  # the sequence ratio of the kept tokens
        log_ratio = (log_ratio * keep if masking else log_ratio).sum().div(kept).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - config.eps_clip_low, 1 + config.eps_clip_high) * advantage
    per_token = -torch.minimum(unclipped, clipped) * is_weight
    if masking:  # only then: the default loss is bit for bit the one without masks
        per_token = per_token * keep
    abs_diff, abs_diff_max, approx_kl, ratio_outside = mismatch_sums(logp, rollout_logprobs)
    stats = LossStats(
        tokens=float(len(logp)), clipped=float((clipped < unclipped).sum()), is_weight=float(is_weight.sum()),
        approx_kl=approx_kl, abs_diff=abs_diff, abs_diff_max=abs_diff_max, ratio_outside=ratio_outside,
        version_gap_masked=gap_masked, icepop_masked=icepop_masked,
    )  # fmt: skip
    return per_token.sum() * weight, stats


class PolicyForward(torch.nn.Module):
    """The policy's trained forward as one module: decoder, then the chunked LM head at the trained positions.

    It is the FSDP2 root (:mod:`rollbus.trainer.sharding`): the parameters outside the decoder layers
    (embeddings, final norm, a tied LM head) are gathered by its forward, once per segment, and reduced by its
    backward; calling the decoder and the head separately would bypass the root's hooks. One process uses it
    unsharded. ``replay`` (:class:`rollbus.trainer.routing_replay.RoutingReplay`, MoE only) forces the
    rollout's experts.
    """

    def __init__(self, policy: PreTrainedModel, replay: RoutingReplay | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.replay = replay

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, chunk: int, prefix: SharedPrefix | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(self.policy, input_ids, positions, chunk, prefix)

    def shares_prefixes(self, config: LossConfig) -> bool:
        """Whether segments may run a shared prefix once: one process, no replay, no recomputed layers."""
        import torch.distributed as dist

        sharded = dist.is_available() and dist.is_initialized()
        recomputed = getattr(self.policy, "is_activation_checkpointing", False)
        return config.shared_prefix_min > 0 and not sharded and self.replay is None and not recomputed

    def routes(self, segment: SegmentInput) -> contextlib.AbstractContextManager[bool]:
        """While open (forward *and* backward, which recomputes checkpointed layers), the segment's recorded
        experts are forced; yields whether they are."""
        if self.replay is None or segment.routed_experts is None:
            return contextlib.nullcontext(False)
        return self.replay.replaying(segment.routed_experts, len(segment.input_ids))


def batch_loss(
    forward: PolicyForward, segments: list[SegmentInput], config: LossConfig, *, backward: bool = True
) -> tuple[float, LossStats]:
    """Loss over ``segments`` (already weighted by the reducer); gradients accumulate segment by segment
    when ``backward``, so only one segment's activations are alive at a time (and a shared prefix's: see the
    module docstring). A ``filler`` segment runs the same forward and backward (every FSDP2 rank must take the
    same collectives) and counts for nothing."""
    total, stats = 0.0, LossStats()
    device = next(forward.parameters()).device
    if forward.shares_prefixes(config):
        firsts = [int(s.positions.min()) if len(s.positions) else len(s.input_ids) for s in segments]
        bundles = shared_prefixes([s.input_ids for s in segments], firsts, config.shared_prefix_min)
    else:
        bundles = [(0, [i]) for i in range(len(segments))]
    for length, members in bundles:
        ids = segments[members[0]].input_ids[:length].to(device)
        prefix = SharedPrefix(forward.policy, ids) if length else None
        for i in members:
            part = _segment_loss(forward, segments[i], config, device, prefix, backward=backward)
            if part is not None:
                total += part[0]
                stats.add(part[1])
        if prefix is not None and backward:
            prefix.backward()
    return total, stats


def _segment_loss(
    forward: PolicyForward,
    segment: SegmentInput,
    config: LossConfig,
    device: torch.device,
    prefix: SharedPrefix | None,
    *,
    backward: bool,
) -> tuple[float, LossStats] | None:
    """One segment's weighted loss (its backward taken if ``backward``) and statistics; None for a filler."""
    ids, positions = segment.input_ids.to(device), segment.positions.to(device)
    own = None
    if config.mismatch_unreplayed and forward.replay is not None:
        # before the trained forward, whose backward reshards what this one gathered (FSDP2's root stays
        # unsharded after a forward); every rank, fillers too, so all take the same collectives
        with torch.no_grad():
            own, _ = forward(ids, positions, config.logits_chunk)
    with forward.routes(segment) as replayed:
        logp, entropy = forward(ids, positions, config.logits_chunk, prefix)
        agreed, recorded = forward.replay.agreement() if replayed and forward.replay else (0, 0)
        loss, seg_stats = segment_loss(
            logp, segment.rollout_logprobs.to(device), segment.advantage, segment.weight, config,
            segment.staleness,
        )
        if segment.filler:
            loss = loss * 0.0
        if backward:
            loss.backward()
    if segment.filler:
        return None
    if own is not None and replayed:
        sums = mismatch_sums(own, segment.rollout_logprobs.to(device))
        seg_stats.unreplayed_tokens = seg_stats.tokens
        seg_stats.unreplayed_abs_diff, seg_stats.unreplayed_abs_diff_max = sums[0], sums[1]
        seg_stats.unreplayed_approx_kl, seg_stats.unreplayed_ratio_outside = sums[2], sums[3]
    seg_stats.entropy = float(entropy.sum())
    seg_stats.replayed = seg_stats.tokens if replayed else 0.0
    seg_stats.routes_agreed, seg_stats.route_positions = float(agreed), float(recorded)
    return float(loss.detach()), seg_stats
