"""One frozen dataclass per event schema (``schemas/<event_type>.avsc``), with its topic, Kafka key and
identity declared beside its fields; nested Avro records and enums are typed too. Generated from the schemas
once and kept by hand: ``tests/test_events_schema.py`` fails when a class and its newest schema disagree (a
field's name, type, optionality or default). ``schema_version`` is the codec's (it stamps it on encode; a
decoded one is in :class:`~rollbus.codec.Decoded`), so no class has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rollbus.events.identity import Identity
from rollbus.events.record import EventRecord, Record

ChainKind = Literal["main", "subagent", "side", "unattributed"]
SessionKind = Literal["opened", "frozen", "closed"]
SegmentKind = Literal["subagent", "wipe", "final"]


@dataclass(frozen=True, kw_only=True)
class TurnTimings(Record):
    """Wall-clock timings of the model call."""

    started_at: int
    finished_at: int
    generation_ms: int


@dataclass(frozen=True, kw_only=True)
class RoutedExperts(Record):
    """A claim check on the experts each MoE layer chose at the positions a turn's request computed: the ids
    live in the routed-experts store (rollbus.routed_experts), not in the event."""

    digest: str
    dtype: str
    start: int
    rows: int
    width: int


@dataclass(frozen=True, kw_only=True)
class TestResult(Record):
    """One test as the grader's parser reported it."""

    __test__: ClassVar[bool] = False  # not a pytest class

    name: str
    status: str


@dataclass(frozen=True, kw_only=True)
class TaskEvent(EventRecord):
    """One rollout to run: a prompt plus what the sandbox needs."""

    event_type = "task"
    topic = "tasks"
    key_field = "rollout_id"
    identity = Identity(("rollout_id",))

    rollout_id: str
    group_id: str
    sample_index: int
    group_size: int
    prompt: str
    label: str | None = None
    metadata: str
    submitted_at: int
    env_config: str | None = None
    ctx_config: str | None = None
    messages: str | None = None
    attempt: int = 0
    refill_of: str | None = None
    refill_reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class TurnEvent(EventRecord):
    """One model call of a rollout, token in / token out, exactly as the engine saw and sampled it."""

    event_type = "turn"
    topic = "turns"
    key_field = "rollout_id"
    # a turn's content digest is rollbus.turn_log.turn_digest: its token arrays hashed as their bytes
    identity = Identity(
        ("rollout_id", "attempt_id", "chain_id", "turn_index"), ("schema_version", "timings")
    )

    rollout_id: str
    chain_id: str
    chain_kind: ChainKind
    turn_index: int
    prompt_ref_turn: int | None = None
    prompt_ids: Sequence[int]
    prompt_tokens: int
    output_ids: Sequence[int]
    output_logprobs: Sequence[float]
    finish_reason: str
    policy_version: int
    request_id: str
    timings: TurnTimings
    attempt_id: str = ""
    routed_experts: RoutedExperts | None = None
    output_top_logprobs: bytes | None = None


@dataclass(frozen=True, kw_only=True)
class SessionEvent(EventRecord):
    """Lifecycle of a chain: opened, frozen (its context was cut: wipe, compaction, subagent hand-back) or
    closed."""

    event_type = "session"
    topic = "sessions"
    key_field = "rollout_id"
    identity = Identity(("rollout_id", "attempt_id", "chain_id", "kind"), ("schema_version", "at"))

    rollout_id: str
    chain_id: str
    kind: SessionKind
    chain_kind: ChainKind
    reason: str | None = None
    turn_count: int
    parent_chain_id: str | None = None
    at: int
    attempt_id: str = ""
    agent_id: str | None = None
    parent_tool_use_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class DiffEvent(EventRecord):
    """What the agent changed in the sandbox when its run ended."""

    event_type = "diff"
    topic = "diffs"
    key_field = "rollout_id"
    identity = Identity(("rollout_id", "attempt_id"))

    rollout_id: str
    patch: bytes
    exit_status: int
    wall_time_s: float
    turns: int
    error: str | None = None
    at: int
    attempt_id: str = ""
    group_id: str = ""
    group_size: int = 1
    failure_kind: str | None = None
    patch_truncated: bool = False
    task_metadata: str = "{}"
    label: str | None = None
    image_digest: str | None = None
    rerun_rollout_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class RewardEvent(EventRecord):
    """Grade of one rollout's patch, computed in a clean sandbox."""

    event_type = "reward"
    topic = "rewards"
    key_field = "rollout_id"
    # a reward's content is its verdict: a grader that crashed after publishing grades the diff again, with
    # a new ``at`` and new durations in ``details``; details' one member that changes training stays content
    identity = Identity(
        ("rollout_id", "attempt_id"), ("schema_version", "at", "details"), (("details", "loss_scope"),)
    )

    rollout_id: str
    reward: float
    solved: bool
    applied_cleanly: bool
    details: str
    failure_kind: str | None = None
    at: int
    attempt_id: str = ""
    group_id: str = ""
    group_size: int = 1
    flags: Sequence[str] = field(default_factory=list)
    tests: Sequence[TestResult] = field(default_factory=list)
    step_rewards: Sequence[float] = field(default_factory=list)
    infos: str = "[]"
    image_digest: str | None = None
    failure_class: str | None = None
    failure_cause: str | None = None
    rerun_rollout_id: str | None = None


@dataclass(frozen=True, kw_only=True)
class SegmentEvent(EventRecord):
    """One training sample cut from a trajectory (a subagent chain, a context before a wipe, or the final
    context), with its share of the reward."""

    event_type = "segment"
    topic = "segments"
    key_field = "rollout_id"
    identity = Identity(("segment_id",))

    segment_id: str
    rollout_id: str
    group_id: str
    index: int
    num_segments: int
    kind: SegmentKind
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    loss_mask: bytes
    rollout_logprobs: Sequence[float]
    reward: float
    trajectory_reward: float
    policy_versions: Sequence[int]
    created_at: int
    attempt_id: str = ""
    chain_id: str = ""
    infos: str = "[]"
    routed_experts: Sequence[RoutedExperts] | None = None
    failure_class: str | None = None
    failure_cause: str | None = None
    rerun_rollout_id: str | None = None
    top_logprobs: bytes | None = None


@dataclass(frozen=True, kw_only=True)
class PolicyEvent(EventRecord):
    """A new version of the policy weights is available."""

    event_type = "policy"
    topic = "policy"
    key_field = None
    # compacted on the one key POLICY_KEY: the latest version wins
    identity = Identity(("version",))

    version: int
    location: str
    published_at: int


@dataclass(frozen=True, kw_only=True)
class DeadLetterEvent(EventRecord):
    """A message a service could not process, kept byte for byte so it can be inspected or replayed."""

    event_type = "dead_letter"
    topic = "dead-letters"
    key_field = None
    identity = Identity(("source_topic", "partition", "offset"))

    source_topic: str
    partition: int
    offset: int
    key: bytes | None = None
    value: bytes
    error: str
    service: str
    at: int


@dataclass(frozen=True, kw_only=True)
class TrainStepEvent(EventRecord):
    """What one optimiser step trained and how far off-policy it was: the trainer's record of the step,
    published after its checkpoint is durable and before its policy version."""

    event_type = "train_step"
    topic = "train-steps"
    key_field = None
    # one partition, in step order
    identity = Identity(("step",))

    step: int
    version: int
    group_ids: Sequence[str]
    segment_ids: Sequence[str]
    rollouts: int
    tokens_trained: int
    response_tokens: int
    masked_fraction: float
    reward_mean: float
    solve_rate: float
    loss: float
    grad_norm: float
    clip_fraction: float
    entropy: float
    approx_kl: float
    logprob_diff_mean: float
    logprob_diff_max: float
    ratio_outside_fraction: float
    replayed_fraction: float
    routing_agreement: float | None = None
    staleness_mean: float
    staleness_min: int
    staleness_max: int
    wait_s: float
    step_s: float
    trained_at: int


# the order is the wire format (an event's position is its type id in the header): append, never insert
EVENT_CLASSES: tuple[type[EventRecord], ...] = (
    TaskEvent, TurnEvent, SessionEvent, DiffEvent, RewardEvent, SegmentEvent, PolicyEvent, DeadLetterEvent,
    TrainStepEvent,
)  # fmt: skip
