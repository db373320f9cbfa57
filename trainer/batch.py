"""From segment events to a training batch: validation, group completion, staleness, reducer weights.

Plain data in, plain data out: a segment is its decoded ``segments`` record (a dict). A step trains whole
groups only: every one of the group's ``group_size`` samples ended, each with all ``num_segments`` of its
segments. A sample the infrastructure failed arrives as one marker segment without tokens
(:mod:`rollbus.failures`): it ends its sample (or, with ``rerun_rollout_id``, leaves its place to the re-run),
and it never trains nor enters the group's mean or std.
The policy is the attacker here: a segment's token ids index the embedding, its lengths index each other, and
its floats enter the loss, so anything malformed is refused with a reason before it is buffered.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from rollbus.events import SegmentEvent
from rollbus.failures import INFRASTRUCTURE
from rollbus.routed_experts import RoutesError, RoutesRef, RoutesStore, cover, load
from rollbus.top_logprobs import PAD_ID, BadTopLogprobs, unpack
from rollbus.trainer.advantages import group_advantages
from rollbus.trainer.loss import SegmentInput
from rollbus.trainer.routing_replay import InvalidRoutes, MoeShape, check_routes

Segment = Mapping[str, Any]
LOGPROB_SLACK = 1e-3  # a log-probability is never positive; this only forgives float rounding


class Admission(Enum):
    BUFFERED = "buffered"
    DUPLICATE = "duplicate"  # a segment id already buffered
    LATE = "late"  # its group was already trained, dropped or skipped
    TWIN = "twin"  # a second valid rollout of a sample that has one (see sample_lineage)
    GROUP_COMPLETE = "group_complete"


class InvalidSegment(ValueError):
    """A segment that can never be trained; the message says why (it goes to dead-letters)."""


def mask_of(segment: Segment) -> bytes:
    return bytes(segment["loss_mask"])


def routed_experts_of(segment: Segment) -> torch.Tensor | None:
    """The segment's recorded MoE routing, ``[positions, layers, top_k]`` integers, if it carries any."""
    routes = segment.get("routed_experts")
    return None if routes is None else torch.as_tensor(routes)


def top_logprobs_of(segment: Segment) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each response token's top-k alternatives under the sampling policy, ``(ids [n, k] int64, logprobs
    [n, k] float32)``, best first; id -1 (logprob 0) where there is none (context tokens, a turn sampled
    without them); None when the segment carries none (the adapter's ``--top-logprobs`` was 0). Raises
    :class:`InvalidSegment` when the value does not fit the segment's response."""
    value = segment.get("top_logprobs")
    if value is None:
        return None
    try:
        ids, logprobs = unpack(bytes(value), len(segment["response_ids"]))
    except BadTopLogprobs as bad:
        raise InvalidSegment(f"segment {segment['segment_id']!r}: top logprobs: {bad}") from None
    return torch.from_numpy(ids.astype("int64")), torch.from_numpy(logprobs.copy())


def fetch_routes(segment: Segment, store: RoutesStore, moe: MoeShape | None) -> Segment:
    """``segment`` with its routed-expert references (the wire's claim check) replaced by the ids they name,
    ``[positions, layers, top_k]``, each part's digest checked; with ``moe`` None (a dense model, or replay
    off) the references are dropped unread. Raises :class:`InvalidSegment` with the reason when they cannot
    be replayed (missing, changed, not covering the segment, another model's shape); the store is only read.
    """
    refs = segment.get("routed_experts")
    if refs is None or moe is None:
        return {**segment, "routed_experts": None}
    name = f"segment {segment['segment_id']!r}"
    try:
        parsed = [RoutesRef.of(ref) for ref in refs]
    except (KeyError, TypeError, ValueError):
        raise InvalidSegment(f"{name}: routed experts are not references to the store") from None
    tokens = len(segment["prompt_ids"]) + len(segment["response_ids"])
    parts = cover(parsed, tokens)
    if parts is None:
        raise InvalidSegment(f"{name}: its routed experts do not cover positions 0..{tokens - 2}")
    try:
        ids = load(parts, store)
    except RoutesError as bad:
        raise InvalidSegment(f"{name}: {bad}") from None
    width = moe.layers * moe.top_k
    if ids.shape[1] != width:
        raise InvalidSegment(
            f"{name}: {ids.shape[1]} routed experts a position, the model has {moe.layers} layers x top "
            f"{moe.top_k}"
        )
    return {**segment, "routed_experts": ids.reshape(len(ids), moe.layers, moe.top_k)}


def infrastructure_failed(segment: Segment) -> bool:
    """A marker of a sample the infrastructure failed (:mod:`rollbus.failures`): never trained, never in
    its group's mean or std."""
    return segment.get("failure_class") == INFRASTRUCTURE


def rerun_of(segment: Segment) -> str | None:
    """The rollout that re-runs an infrastructure-failed sample, if one was submitted."""
    rerun = segment.get("rerun_rollout_id")
    return rerun if infrastructure_failed(segment) and isinstance(rerun, str) and rerun else None


_RERUN = re.compile(r"\.r\d+(?=(-\d+)?$)")


def sample_lineage(rollout_id: str) -> str:
    """The sample a rollout is a run of: its id without the re-run mark the runner puts in a re-run's id
    (``<id>.r<N>``, before the ``-<sample index>`` suffix; services/sandbox_runner/rerun.py), so a sample's
    first rollout and each of its re-runs share it."""
    return _RERUN.sub("", rollout_id)


def validate(segment: Segment, vocab_size: int, moe: MoeShape | None = None) -> None:
    """Raise :class:`InvalidSegment` unless ``segment`` is internally consistent and fits the model (``moe``:
    the model's routing shape, against which recorded experts are checked; None for a dense model)."""
    if infrastructure_failed(segment):
        if segment["prompt_ids"] or segment["response_ids"] or segment["num_segments"] != 1:
            raise InvalidSegment(f"segment {segment['segment_id']!r}: an infrastructure marker has tokens")
        return
    n = len(segment["response_ids"])
    mask = mask_of(segment)
    if len(mask) != n or len(segment["rollout_logprobs"]) != n or len(segment["policy_versions"]) != n:
        raise InvalidSegment(f"segment {segment['segment_id']!r}: per-token arrays disagree in length")
    if any(b not in (0, 1) for b in mask):
        raise InvalidSegment(f"segment {segment['segment_id']!r}: loss_mask bytes must be 0 or 1")
    if not 0 <= segment["index"] < segment["num_segments"]:
        raise InvalidSegment(f"segment {segment['segment_id']!r}: index outside 0..num_segments-1")
    if not segment["prompt_ids"]:
        raise InvalidSegment(f"segment {segment['segment_id']!r}: empty prompt (nothing to predict from)")
    ids = (*segment["prompt_ids"], *segment["response_ids"])
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise InvalidSegment(f"segment {segment['segment_id']!r}: token id outside the vocabulary")
    masked = [lp for lp, m in zip(segment["rollout_logprobs"], mask, strict=True) if m]
    if not all(math.isfinite(lp) and lp <= LOGPROB_SLACK for lp in masked):
        raise InvalidSegment(f"segment {segment['segment_id']!r}: rollout logprob not finite or above 0")
    if not math.isfinite(segment["trajectory_reward"]):
        raise InvalidSegment(f"segment {segment['segment_id']!r}: trajectory_reward is not finite")
    top = top_logprobs_of(segment)
    if top is not None and top[0].numel():
        if int(top[0].min()) < PAD_ID or int(top[0].max()) >= vocab_size:
            name = segment["segment_id"]
            raise InvalidSegment(f"segment {name!r}: a top-k token id outside the vocabulary")
        if not bool(torch.isfinite(top[1]).all()) or float(top[1].max()) > LOGPROB_SLACK:
            raise InvalidSegment(f"segment {segment['segment_id']!r}: a top-k logprob not finite or above 0")
    if moe is not None:
        try:
            routes = routed_experts_of(segment)
            if routes is not None:
                check_routes(routes, len(ids), moe)
        except (InvalidRoutes, TypeError, ValueError, RuntimeError) as bad:
            raise InvalidSegment(f"segment {segment['segment_id']!r}: {bad}") from None


def staleness(segment: Segment, current_version: int) -> int:
    """Versions between the policy now and the oldest policy that sampled one of its trained tokens."""
    versions = [v for v, m in zip(segment["policy_versions"], mask_of(segment), strict=True) if m]
    return current_version - min(versions) if versions else 0


@dataclass
class Group:
    group_id: str
    rollouts: dict[str, dict[int, Segment]] = field(default_factory=dict)
    first_created_at: int | None = None  # event time (ms) of its earliest segment, for abandoning it

    def segments(self) -> list[Segment]:
        """Every segment, in a fixed order (rollout id, index): the batch never depends on arrival order."""
        return [self.rollouts[r][i] for r in sorted(self.rollouts) for i in sorted(self.rollouts[r])]

    def rewards(self) -> dict[str, float]:
        """The trajectory reward of every valid sample: an infrastructure-failed one has none."""
        return {r: float(_first(segs)["trajectory_reward"]) for r, segs in self.valid().items()}

    def valid(self) -> dict[str, dict[int, Segment]]:
        """The samples that may train: every one with all its segments, but the infrastructure-failed ones
        (an over-sampled group completes with some samples still arriving: those never train)."""
        return {
            r: segs for r, segs in self.rollouts.items()
            if _whole(segs) and not infrastructure_failed(_first(segs))
        }  # fmt: skip

    def valid_run_of(self, lineage: str) -> str | None:
        """The rollout of sample ``lineage`` that is not infrastructure-failed, if one is buffered."""
        for rollout_id, segments in self.rollouts.items():
            if sample_lineage(rollout_id) == lineage and not infrastructure_failed(_first(segments)):
                return rollout_id
        return None

    def infrastructure_failed(self) -> list[str]:
        """Rollout ids of the samples the infrastructure failed (re-run or not)."""
        return sorted(r for r, segs in self.rollouts.items() if infrastructure_failed(_first(segs)))

    def reruns(self) -> int:
        """Infrastructure-failed samples whose re-run takes their place: each admits one more rollout."""
        return sum(1 for segs in self.rollouts.values() if rerun_of(_first(segs)) is not None)

    def ended(self) -> int:
        """Samples that ended for good: valid, or infrastructure-failed with no re-run to come."""
        return len(self.rollouts) - self.reruns()


def _first(segments: Mapping[int, Segment]) -> Segment:
    """Any segment of a rollout: all of them share its reward, attempt and failure class."""
    return next(iter(segments.values()))


def _whole(segments: Mapping[int, Segment]) -> bool:
    """Whether all the rollout's segments are here."""
    return len(segments) == _first(segments)["num_segments"]


class GroupBuffer:
    """Segments of groups not yet complete; completed groups queue in completion order."""

    def __init__(self, group_size: int, over_sample: int = 0) -> None:
        self.group_size = group_size
        self.over_sample = over_sample  # groups are submitted with group_size + over_sample samples
        self.pending: dict[str, Group] = {}
        self.complete: list[Group] = []
        # groups trained, dropped or skipped -> the event time (ms) they finished at: later segments are late
        self.finished: dict[str, int] = {}
        self.clock_ms = 0  # the newest segment time seen: finishing and forgetting replay identically
        self._ids: set[tuple[Any, ...]] = set()  # the buffered segments' identity keys

    def add(self, segment: Segment) -> Admission:
        group_id, rollout_id = segment["group_id"], segment["rollout_id"]
        if group_id in self.finished or any(g.group_id == group_id for g in self.complete):
            return Admission.LATE
        if SegmentEvent.key_of(segment) in self._ids:
            return Admission.DUPLICATE
        if self._is_twin(segment):
            return Admission.TWIN
        group = self.pending.setdefault(group_id, Group(group_id))
        rollout = group.rollouts.get(rollout_id)
        if rollout is None:
            samples = self.group_size + self.over_sample
            if group.ended() + (rerun_of(segment) is None) > samples:
                raise InvalidSegment(f"group {group_id!r} already has {samples} rollouts")
            rollout = group.rollouts.setdefault(rollout_id, {})
        self._check_fits(rollout, segment)
        rollout[segment["index"]] = segment
        created = int(segment.get("created_at", 0))
        self.clock_ms = max(self.clock_ms, created)
        group.first_created_at = min(created, group.first_created_at or created)
        self._ids.add(SegmentEvent.key_of(segment))
        if self._is_complete(group):
            del self.pending[group_id]
            self.complete.append(group)
            return Admission.GROUP_COMPLETE
        return Admission.BUFFERED

    def dropped(self, segment: Segment) -> bool:
        """Whether :meth:`add` will drop ``segment`` unread (late, duplicate, twin): nothing to fetch."""
        group_id = segment["group_id"]
        late = group_id in self.finished or any(g.group_id == group_id for g in self.complete)
        return late or SegmentEvent.key_of(segment) in self._ids or self._is_twin(segment)

    def _is_twin(self, segment: Segment) -> bool:
        """A runner killed between publishing a re-run and the failed attempt's diff runs the task again:
        should both succeed, the sample has two valid rollouts. The first to arrive keeps the sample's
        place; a segment of the other is a twin, which never enters the group (nor its mean)."""
        group = self.pending.get(segment["group_id"])
        rollout_id = segment["rollout_id"]
        if group is None or rollout_id in group.rollouts or infrastructure_failed(segment):
            return False
        return group.valid_run_of(sample_lineage(rollout_id)) is not None

    def _check_fits(self, rollout: dict[int, Segment], segment: Segment) -> None:
        if not rollout:
            return
        first = next(iter(rollout.values()))
        for key in ("num_segments", "attempt_id", "trajectory_reward", "failure_class"):
            if segment.get(key) != first.get(key):
                raise InvalidSegment(f"segment {segment['segment_id']!r}: {key} differs from its rollout's")
        if segment["index"] in rollout:
            raise InvalidSegment(f"segment {segment['segment_id']!r}: index {segment['index']} already taken")

    def _is_complete(self, group: Group) -> bool:
        """Every sample ended for good (valid, or infrastructure-failed with no re-run to come), each with
        all its segments; a re-run that arrives before its failed sample's marker fills the sample's place.
        Over-sampled (``over_sample`` k: groups of n + k), the group completes as soon as n samples are valid
        and whole (the first n: the rest arrive late), or once all n + k ended."""
        if self.over_sample and len(group.valid()) >= self.group_size:
            return True
        return group.ended() == self.group_size + self.over_sample and all(
            _whole(r) for r in group.rollouts.values()
        )

    def take(self, n: int) -> list[Group]:
        """The first ``n`` completed groups, marked finished."""
        taken, self.complete = self.complete[:n], self.complete[n:]
        for group in taken:
            self.finish(group)
        return taken

    def finish(self, group: Group) -> None:
        self.finished[group.group_id] = self.clock_ms
        for segment in group.segments():
            self._ids.discard(SegmentEvent.key_of(segment))

    def drop_complete(self, group: Group) -> None:
        """Remove a completed group that will not be trained (stale or without reward variance)."""
        self.complete.remove(group)
        self.finish(group)

    def abandon(self, group_id: str) -> Group | None:
        """Give up on a group that can never complete (a segment was poison); later segments are late."""
        group = self.pending.pop(group_id, None)
        if group is not None:
            self.finish(group)
        else:
            self.finished[group_id] = self.clock_ms
        return group

    def forget(self, horizon_ms: int) -> int:
        """Forget groups finished more than ``horizon_ms`` (segment time) ago, so the set stays bounded; a
        segment of one arriving after that would start a new group. The number forgotten."""
        old = [g for g, at in self.finished.items() if at < self.clock_ms - horizon_ms]
        for group_id in old:
            del self.finished[group_id]
        return len(old)

    def expire(self, now_ms: int, timeout_ms: int) -> list[Group]:
        """Abandon incomplete groups whose first segment is more than ``timeout_ms`` older than ``now_ms``
        (event time from the log, so a replay abandons the same groups); they are finished, never trained."""
        old = [g for g in self.pending.values() if g.first_created_at is not None
               and now_ms - g.first_created_at > timeout_ms]  # fmt: skip
        for group in old:
            del self.pending[group.group_id]
            self.finish(group)
        return old

    def buffered(self) -> list[Segment]:
        return [s for g in (*self.pending.values(), *self.complete) for s in g.segments()]


def too_few_valid(group: Group, minimum: int, group_size: int) -> str | None:
    """Why a completed group is dropped for the samples the infrastructure failed (fewer valid ones than
    ``minimum``, at most ``group_size``), else None."""
    valid, failed = len(group.valid()), len(group.infrastructure_failed())
    if valid >= min(minimum, group_size):
        return None
    return (f"{valid} valid sample(s) of {group_size} after {failed} infrastructure failure(s) "
            f"(minimum {min(minimum, group_size)})")  # fmt: skip


def segment_inputs(
    groups: Sequence[Group], *, normalize_std: bool, version: int | None = None
) -> list[SegmentInput]:
    """Every trainable segment of ``groups`` with its trajectory's advantage and its reducer weight. Only
    valid samples: an infrastructure-failed one enters neither its group's mean and std nor the batch."""
    rollouts = sum(len(g.valid()) for g in groups)
    inputs = []
    for group in groups:
        advantages = group_advantages(group.rewards(), normalize_std=normalize_std)
        for rollout_id, segments in sorted(group.valid().items()):
            mask_total = sum(sum(mask_of(s)) for s in segments.values())
            for index in sorted(segments):
                segment = segments[index]
                if sum(mask_of(segment)) == 0:
                    continue
                weight = 1.0 / (mask_total * rollouts)
                inputs.append(_input(segment, advantages[rollout_id], weight, version))
    return inputs


def _input(segment: Segment, advantage: float, weight: float, version: int | None = None) -> SegmentInput:
    """``version``: the policy the step trains from, against which each trained token's staleness is taken
    (the loss's version-gap mask); None: unknown."""
    prompt = segment["prompt_ids"]
    mask = torch.frombuffer(bytearray(mask_of(segment)), dtype=torch.uint8).bool()
    masked = torch.nonzero(mask)[:, 0]
    stale = None
    if version is not None:
        stale = version - torch.tensor(segment["policy_versions"], dtype=torch.long)[masked]
    return SegmentInput(
        input_ids=torch.tensor([*prompt, *segment["response_ids"]], dtype=torch.long),
        positions=masked + len(prompt),
        rollout_logprobs=torch.tensor(segment["rollout_logprobs"], dtype=torch.float32)[masked],
        advantage=advantage,
        weight=weight,
        routed_experts=routed_experts_of(segment),
        staleness=stale,
    )


def split_for_ranks(inputs: Sequence[SegmentInput], world_size: int) -> list[list[SegmentInput]]:
    """Deal segments to ranks, longest first to the least-loaded rank (by tokens): deterministic."""
    shares: list[list[SegmentInput]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    order = sorted(range(len(inputs)), key=lambda i: (-len(inputs[i].input_ids), i))
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(inputs[i])
        load[rank] += len(inputs[i].input_ids)
    return shares
