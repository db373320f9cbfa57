"""Settings of ``rollbus trainer`` (flags ``--x-y``, variables ``ROLLBUS_TRAINER_X_Y``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, SecretStr

from rollbus.policy_model import ModelSettings
from rollbus.settings import BusSettings

if TYPE_CHECKING:  # torch comes with them: imported when the trainer runs, not for --help
    from rollbus.trainer.loss import LossConfig
    from rollbus.trainer.step import OptimConfig

DeviceChoice = Literal["auto", "cpu", "cuda"]
PrecisionChoice = Literal["auto", "fp32", "bf16"]


class TrainerSettings(ModelSettings, BusSettings):
    """Settings of `rollbus trainer` (flags --x-y, variables ROLLBUS_TRAINER_X_Y)."""

    model_config = BusSettings.scoped("trainer")

    # -- what a step is
    group_size: int = Field(8, gt=0, description="rollouts per group (all must arrive before it trains)")
    rollout_batch_size: int = Field(8, gt=0, description="complete groups per optimiser step")
    steps: int = Field(0, ge=0, description="stop at this many steps in total (across restarts); 0: never")
    skip_zero_variance: bool = Field(True, description="skip groups whose rollouts all scored the same")
    over_sample: int = Field(
        0, ge=0, description="groups are submitted with --group-size + N samples (rollbus submit "
        "--n-samples-per-prompt): each trains its first --group-size valid ones, the rest arrive late"
    )
    min_valid_samples: int = Field(
        2, ge=1, description="drop a group (counted) left with fewer valid samples than this (at most its "
        "size) once its infrastructure failures are out: those never train nor enter its mean"
    )
    refill_dataset: Path | None = Field(
        None, description="replace every group that will not train (no reward variance, lost to "
        "infrastructure, stale, poisoned, abandoned) by a new group of this dataset's next row, submitted to "
        "tasks (rollbus submit's formats); unset: no refill"
    )
    refill_max_depth: int = Field(
        3, ge=1, description="a replacement's replacement is one generation deeper: past this many a lost "
        "group is not replaced (counted as refills_too_deep)"
    )
    max_staleness: int | None = Field(
        None, ge=0, description="drop groups sampled more than N policy versions ago; unset: keep all"
    )
    group_timeout: float = Field(
        10800.0,
        ge=0,
        description="abandon a group still incomplete this many seconds (segment time) after "
        "its first segment; 0: wait forever",
    )
    forget_finished_after: float = Field(
        604800.0,
        ge=0,
        description="seconds (segment time) a finished group is remembered, so its late or re-cut segments "
        "are dropped, not trained again; bounds the checkpoint's list; 0: remember forever",
    )
    solve_threshold: float = Field(1.0, description="trajectory reward at which a rollout counts as solved")
    # -- the loss
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo", description="token-level PPO clip, or sequence-level GSPO"
    )
    eps_clip_low: float = Field(0.2, ge=0, lt=1, description="lower clip range of the importance ratio")
    eps_clip_high: float = Field(0.28, ge=0, description="upper clip range of the importance ratio")
    tis_clip: float | None = Field(
        None, gt=0, description="truncated importance sampling against the rollout policy, capped at C"
    )
    normalize_std: bool = Field(True, description="divide group advantages by the group's reward std")
    max_version_gap: int | None = Field(
        None, ge=0, description="mask (leave out of the loss) tokens sampled more than N policy versions "
        "before the step's (a partial rollout's oldest turns); unset: none; counted as "
        "version_gap_masked_fraction"
    )
    icepop_low: float | None = Field(
        None, gt=0, description="IcePop: mask tokens whose pi_trainer / pi_rollout is below this (with "
        "--icepop-high); counted as icepop_masked_fraction"
    )
    icepop_high: float | None = Field(
        None, gt=0, description="IcePop: mask tokens whose pi_trainer / pi_rollout is above this (with "
        "--icepop-low)"
    )
    logits_chunk: int = Field(
        512,
        ge=0,
        description="trained positions per LM-head chunk (peak ~2 x chunk x vocab floats); 0: full",
    )
    shared_prefix_min: int = Field(
        256, ge=0, description="segments of a step starting with at least this many equal tokens (a group's "
        "shared prompt) run them once; 0: every segment runs whole"
    )
    # -- the optimiser
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient norm clip")
    # -- the model (random Qwen3 or Qwen3-MoE like the engine's, unless --model-path) and where it runs
    routing_replay: bool = Field(
        True, description="MoE: force each layer's top-k to the experts the rollout recorded (R3); off: "
        "the trainer routes on its own"
    )
    routed_experts_dir: Path | None = Field(
        None, description="MoE with replay: where the adapter stored the routed experts segments refer to; "
        "unset: <state-dir>/routed-experts"
    )
    routed_experts_retention: float = Field(
        86400.0, ge=0, description="MoE: seconds after which routed experts not stored again are deleted "
        "from the store (keep it above the longest a segment waits to train); 0: keep them"
    )
    routed_experts_prune_every: float = Field(
        600.0, gt=0, description="MoE: seconds between walks of the routed experts store for "
        "--routed-experts-retention (each walk lists the whole directory)"
    )
    mismatch_unreplayed: bool = Field(
        False, description="MoE with replay: also measure the mismatch on the trainer's own routing (one "
        "more forward per segment; the unreplayed_* metrics)"
    )
    device: DeviceChoice = Field("auto", description="cpu or cuda (auto: cuda when present)")
    precision: PrecisionChoice = Field(
        "auto", description="compute dtype, parameters and AdamW state stay fp32 (auto: bf16 on a GPU with "
        "bf16, fp32 on the CPU)"
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer in backward instead of keeping its activations"
    )
    dist_timeout: float = Field(
        86400.0, gt=0, description="seconds ranks wait for rank 0's next batch (torchrun) before giving up"
    )
    threads: int = Field(0, ge=0, description="torch CPU threads (0: all cores)")
    # -- where things go
    checkpoint_dir: Path | None = Field(
        None, description="versioned checkpoints; unset: <state-dir>/trainer/<namespace or default>"
    )
    keep_checkpoints: int = Field(3, ge=2, description="checkpoint versions kept on disk")
    consumer_group: str = Field("trainer", min_length=1, description="Kafka consumer group on segments")
    max_poll_interval: float = Field(
        900.0, gt=0, description="seconds a step may take before Kafka evicts the consumer"
    )
    session_timeout: float = Field(
        30.0, gt=0, description="seconds without heartbeats before Kafka counts the trainer gone"
    )
    engine_url: str = Field("", description="engine to push new weights to; empty: publish to policy only")
    engine_api_key: SecretStr | None = Field(None, description="the engine's API key (sent as Bearer)")
    engine_timeout: float = Field(300.0, gt=0, description="seconds the engine may take to load weights")
    engine_retries: int = Field(3, ge=0, description="retries of a failed weight push before moving on")

    def loss(self) -> LossConfig:
        from rollbus.trainer.loss import LossConfig

        return LossConfig(
            policy_loss=self.policy_loss, eps_clip_low=self.eps_clip_low, eps_clip_high=self.eps_clip_high,
            tis_clip=self.tis_clip, logits_chunk=self.logits_chunk,
            mismatch_unreplayed=self.mismatch_unreplayed, max_version_gap=self.max_version_gap,
            icepop=self.icepop(), shared_prefix_min=self.shared_prefix_min,
        )  # fmt: skip

    def icepop(self) -> tuple[float, float] | None:
        if self.icepop_low is None and self.icepop_high is None:
            return None
        return (self.icepop_low or 0.0, self.icepop_high if self.icepop_high is not None else float("inf"))

    def optim(self) -> OptimConfig:
        from rollbus.trainer.step import OptimConfig

        return OptimConfig(lr=self.lr, weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm)

    def routes_dir(self) -> Path:
        from rollbus.routed_experts import STORE_DIR

        return self.routed_experts_dir or self.state_dir / STORE_DIR

    def checkpoints(self) -> Path:
        return self.checkpoint_dir or self.state_dir / "trainer" / (self.namespace or "default")
