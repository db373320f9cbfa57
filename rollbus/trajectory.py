"""Turns -> token segments with loss masks, fan-out and reward split (pure, no I/O).

The promise: a token carries ``loss_mask=1`` only if the rollout model sampled it, at that position,
and it carries the logprob it was sampled with. Everything else (system prompt, tool results, user
text, template tokens, re-rendered history) is context with mask 0 and logprob 0.

Two ways to stitch a chain's turns into one sequence:

* :func:`segment_chain` for canonical (append-only) chains, where every prompt extends the previous
  stream token for token (the adapter's canonical history); anything else is a bug and raises.
* :func:`merge_turns` / :func:`merge_turns_all` for re-rendered histories (slime-compatible), where
  each prompt is a fresh rendering and may drift from the tokens that were sampled.

Policy versions: ``policy_versions[i]`` is the version of the policy that sampled token ``i`` when the
token came from a sampled output (mask 1, or mask 0 for the kept part of an output cut by drift), and
``-1`` for context the model never sampled. Trainers can then measure staleness per trained token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

import numpy as np

log = logging.getLogger(__name__)

CONTEXT_VERSION = -1
LossScope = Literal["all_turns", "last_turn"]
SegmentKind = Literal["subagent", "wipe", "final"]
HistoryMode = Literal["canonical", "rerender"]
# a chain's end reason (a ``session`` event's ``reason``) when its origin is unproven: the adapter freezes
# such a chain with it, and the segmenter never trains it
AMBIGUOUS = "ambiguous"


@dataclass
class Turn:
    """One generation call: the exact prompt sent and what the model sampled."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    policy_version: int
    chain_id: str | None = None
    turn_index: int | None = None


@dataclass
class ChainTokens:
    """A prompt and a response with per-token loss mask, logprobs and policy versions.

    ``output_spans`` holds ``(start, end)`` of each sampled output still trained, in response
    coordinates, oldest first: what ``last_turn`` loss scope needs. ``misaligned_tokens`` counts sampled
    tokens left untrained (mask 0) because their turn's logprobs did not line up with its ids.

    Built turn by turn, the fields are lists. :func:`rollbus.turn_log.chain_arrays` builds a finished one
    whose fields are numpy arrays (ids and versions int64, logprobs float32, mask uint8), never appended to.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    output_spans: list[tuple[int, int]] = field(default_factory=list)
    misaligned_tokens: int = 0

    def append_context(self, ids: Sequence[int]) -> None:
        self.response_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.rollout_logprobs.extend([0.0] * len(ids))
        self.policy_versions.extend([CONTEXT_VERSION] * len(ids))

    def append_output(self, turn: Turn) -> None:
        """Append a sampled output with mask 1. If its logprobs don't line up with its ids, it is kept
        as context (mask 0) and counted: a made-up logprob would corrupt the importance ratio."""
        ids = turn.output_ids
        if not ids:
            return
        logprobs = list(turn.output_logprobs)
        mask = 1
        if not aligned(len(ids), len(logprobs), turn.turn_index, turn.chain_id):
            logprobs, mask = [0.0] * len(ids), 0
            self.misaligned_tokens += len(ids)
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.loss_mask.extend([mask] * len(ids))
        self.rollout_logprobs.extend(logprobs)
        self.policy_versions.extend([turn.policy_version] * len(ids))
        self.output_spans.append((start, len(self.response_ids)))

    def truncate(self, length: int) -> None:
        """Drop the response from ``length`` on; an output cut strictly inside stops being trained."""
        for span_index, (start, end) in enumerate(self.output_spans):
            if end <= length:
                continue
            if start < length:
                self.loss_mask[start:length] = [0] * (length - start)
                self.rollout_logprobs[start:length] = [0.0] * (length - start)
            del self.output_spans[span_index:]
            break
        del self.response_ids[length:]
        del self.loss_mask[length:]
        del self.rollout_logprobs[length:]
        del self.policy_versions[length:]


def aligned(outputs: int, logprobs: int, turn_index: int | None, chain_id: str | None) -> bool:
    """Whether a turn's ``logprobs`` line up with its ``outputs`` ids; a turn whose do not is logged (its
    output is kept as context, untrained: a made-up logprob would corrupt the importance ratio)."""
    if logprobs == outputs:
        return True
    log.warning(
        "turn %s of chain %s has %d logprobs for %d output tokens; not training them",
        turn_index, chain_id, logprobs, outputs,
    )
    return False


T = TypeVar("T", bound=ChainTokens)


class ChainBroken(ValueError):
    """A canonical chain's turn does not extend the previous stream: the recorder has a bug."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]; bisect on C-speed slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def segment_chain(turns: Sequence[Turn]) -> ChainTokens:
    """Stitch a canonical chain: each prompt must start with the previous prompt + output.

    Whatever a prompt adds after that (closing template tokens, tool results, user text) is context.
    """
    if not turns:
        raise ValueError("a chain needs at least one turn")
    tokens = ChainTokens(prompt_ids=list(turns[0].prompt_ids))
    tokens.append_output(turns[0])
    stream_length = len(tokens.prompt_ids) + len(tokens.response_ids)
    for previous, turn in zip(turns, turns[1:], strict=False):
        head = turn.prompt_ids[: len(tokens.prompt_ids)]
        body = turn.prompt_ids[len(tokens.prompt_ids) : stream_length]
        if head != tokens.prompt_ids or body != tokens.response_ids:
            raise ChainBroken(
                f"turn {turn.turn_index} of chain {turn.chain_id} does not extend turn {previous.turn_index}"
            )
        tokens.append_context(turn.prompt_ids[stream_length:])
        tokens.append_output(turn)
        stream_length = len(tokens.prompt_ids) + len(tokens.response_ids)
    return tokens


def merge_turns_all(turns: Iterable[Turn]) -> list[ChainTokens]:
    """Stitch re-rendered turns (slime-compatible); one sequence per prompt base.

    A turn whose prompt does not start with the current sequence's prompt restarts: the current
    sequence is emitted and a new one starts from that prompt. Otherwise the response so far is cut
    at its longest common prefix with the new prompt's tail, the rest of the prompt is appended as
    context and the new output as trained tokens. A sequence left with no trained token is dropped
    (it would only dilute the reward split); nothing is dropped for length.
    """
    sequences: list[ChainTokens] = []
    current: ChainTokens | None = None
    for turn in turns:
        if current is None or turn.prompt_ids[: len(current.prompt_ids)] != current.prompt_ids:
            if current is not None:
                sequences.append(current)
            current = ChainTokens(prompt_ids=list(turn.prompt_ids))
        else:
            tail = turn.prompt_ids[len(current.prompt_ids) :]
            kept = common_prefix_length(current.response_ids, tail)
            current.truncate(kept)
            current.append_context(tail[kept:])
        current.append_output(turn)
    if current is not None:
        sequences.append(current)
    return [s for s in sequences if trains(s)]


def merge_turns(turns: Iterable[Turn], *, loss_scope: LossScope = "all_turns") -> ChainTokens | None:
    """The sequence slime would train on: the last prompt base's (earlier bases: see merge_turns_all)."""
    sequences = merge_turns_all(turns)
    return apply_loss_scope(sequences[-1], loss_scope) if sequences else None


def trains(tokens: ChainTokens) -> bool:
    """Whether any token of ``tokens`` carries loss (lists or numpy arrays alike)."""
    mask = tokens.loss_mask
    return bool(mask.any()) if isinstance(mask, np.ndarray) else any(mask)


def apply_loss_scope(tokens: T, scope: LossScope) -> T:
    """``all_turns`` trains every kept output; ``last_turn`` only the last one (returns a copy). Tokens held
    as lists or as numpy arrays (:func:`rollbus.turn_log.chain_arrays`) keep their representation."""
    if scope == "all_turns":
        return tokens
    if scope != "last_turn":
        raise ValueError(f"unknown loss scope {scope!r}")
    keep = tokens.output_spans[-1:] if tokens.output_spans else []
    if isinstance(tokens.loss_mask, np.ndarray):
        mask, logprobs = np.zeros_like(tokens.loss_mask), np.zeros_like(tokens.rollout_logprobs)
    else:
        mask, logprobs = [0] * len(tokens.loss_mask), [0.0] * len(tokens.rollout_logprobs)
    for start, end in keep:
        mask[start:end] = tokens.loss_mask[start:end]
        logprobs[start:end] = tokens.rollout_logprobs[start:end]
    return replace(tokens, loss_mask=mask, rollout_logprobs=logprobs, output_spans=list(keep))


@dataclass(kw_only=True)
class Segment(ChainTokens):
    """One training sample of a trajectory: ``reward`` is its share, ``trajectory_reward`` the whole.

    Group-normalised advantages must use ``trajectory_reward`` (see :func:`group_advantages`), so a
    trajectory that fanned out into many segments does not weigh more than one that did not.
    """

    rollout_id: str
    index: int
    num_segments: int
    kind: SegmentKind
    chain_id: str | None
    reward: float
    trajectory_reward: float


@dataclass
class FrozenChain:
    """A chain that will not grow any more, and why it stopped."""

    kind: SegmentKind
    turns: list[Turn]
    history_mode: HistoryMode = "canonical"
    chain_id: str | None = None

    def sequences(self) -> list[ChainTokens]:
        if not self.turns:
            return []
        if self.history_mode == "canonical":
            tokens = segment_chain(self.turns)
            return [tokens] if trains(tokens) else []
        return merge_turns_all(self.turns)


def fan_out(
    chains: Sequence[FrozenChain],
    rollout_id: str,
    reward: float,
    *,
    loss_scope: LossScope = "all_turns",
) -> list[Segment]:
    """One segment per non-empty chain sequence, in freeze order; each gets ``reward / K``."""
    pieces = [(chain, seq) for chain in chains for seq in chain.sequences()]
    count = len(pieces)
    segments = []
    for index, (chain, seq) in enumerate(pieces):
        scoped = apply_loss_scope(seq, loss_scope)
        segments.append(
            Segment(
                prompt_ids=scoped.prompt_ids,
                response_ids=scoped.response_ids,
                loss_mask=scoped.loss_mask,
                rollout_logprobs=scoped.rollout_logprobs,
                policy_versions=scoped.policy_versions,
                output_spans=scoped.output_spans,
                misaligned_tokens=scoped.misaligned_tokens,
                rollout_id=rollout_id,
                index=index,
                num_segments=count,
                kind=chain.kind,
                chain_id=chain.chain_id,
                reward=reward / count,
                trajectory_reward=reward,
            )
        )
    return segments


def group_advantages(
    trajectory_rewards_by_rollout: dict[str, float], *, normalize_std: bool = False, eps: float = 1e-6
) -> dict[str, float]:
    """GRPO-style advantage per trajectory: reward minus the group mean (optionally over its std).

    Computed over trajectories, not segments, so uneven fan-out cannot bias the baseline; every
    segment of a rollout then carries its trajectory's advantage.
    """
    if not trajectory_rewards_by_rollout:
        return {}
    rewards = list(trajectory_rewards_by_rollout.values())
    mean = sum(rewards) / len(rewards)
    scale = 1.0
    if normalize_std:
        variance = sum((r - mean) ** 2 for r in rewards) / len(rewards)
        scale = variance**0.5 + eps
    return {rollout: (r - mean) / scale for rollout, r in trajectory_rewards_by_rollout.items()}
