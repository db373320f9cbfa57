"""Who a failed rollout is the fault of: the one place every way a rollout can end is classified.

A rollout ends with a failure kind named by whoever saw it end: the sandbox runner (``diffs.failure_kind``),
the sandbox under it (a limit hit), the gym runner or the grader (``rewards.failure_kind``). Each kind is
either

* ``policy``: something the policy did or could have caused (it timed out, looped, crashed, overflowed its
  context, broke or exhausted its own sandbox, gave no patch or an oversized one, its tests fail). Reward 0,
  and the sample trains like any other: the policy must learn from it;
* ``infrastructure``: something observed before the agent ran or outside its reach (the sandbox could not be
  created, the engine or the adapter failed, a runner or grader crashed, the image or the row is missing or
  broken). The sample never trains and never enters its group's mean or std; it is re-run as a new attempt.

The policy is the attacker: a failure it could have caused must never be infrastructure, or a policy that
learns to crash the machinery escapes its zero. So a kind is infrastructure only when it names a failure
that happened where the agent has no reach (before its process started, or in a service it never talks to),
and every kind not listed here, however it came to be, is ``policy`` (fail closed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FailureClass = Literal["policy", "infrastructure"]
POLICY: FailureClass = "policy"
INFRASTRUCTURE: FailureClass = "infrastructure"


@dataclass(frozen=True)
class Kind:
    """One way a rollout can end badly: its class, who names it, and whether running it again can help."""

    name: str
    failure_class: FailureClass
    named_by: str
    why: str
    rerun_helps: bool = False  # infrastructure only: a new attempt may succeed (a bad row never will)


def _kinds(*kinds: Kind) -> dict[str, Kind]:
    return {kind.name: kind for kind in kinds}


_RUNNER, _SANDBOX, _GRADER, _GYM = "sandbox runner", "sandbox", "grader", "gym runner"

# Every known kind. Names shared by two writers (``timeout``, ``runner_error``, ``patch_failed``,
# ``patch_too_large``) mean the same class for each.
KINDS: dict[str, Kind] = _kinds(
    # -- the sandbox runner, before the agent runs (outside its reach)
    Kind("bad_task", INFRASTRUCTURE, _RUNNER, "the task's metadata is unusable: no run could start"),
    Kind("boot_failed", INFRASTRUCTURE, _RUNNER, "the sandbox or its image could not be built", True),
    Kind("install_failed", INFRASTRUCTURE, _RUNNER, "the agent's CLI could not be made available", True),
    Kind("session_failed", INFRASTRUCTURE, _RUNNER, "the adapter refused or did not answer a session", True),
    Kind("runner_error", INFRASTRUCTURE, _RUNNER, "the runner failed before the agent started", True),
    # -- the sandbox runner, once the agent has run (its doing, or within its reach)
    Kind("timeout", POLICY, _RUNNER, "the agent ran past its wall-clock budget"),
    Kind("agent_crashed", POLICY, _RUNNER, "the agent's CLI exited non-zero or was killed by a signal"),
    Kind("max_turns", POLICY, _RUNNER, "the agent stopped at the turn limit"),
    Kind("patch_too_large", POLICY, _RUNNER, "the patch exceeded the cap"),
    Kind("patch_failed", POLICY, _RUNNER, "git gave no patch: the capture hit the sandbox's limits"),
    Kind("sandbox_broken", POLICY, _RUNNER, "the sandbox failed after the agent ran in it (it may have "
         "broken it)"),  # fmt: skip
    # -- limits the sandbox enforced on the agent's processes
    Kind("memory_limit", POLICY, _SANDBOX, "the agent exhausted its memory limit"),
    Kind("pids_limit", POLICY, _SANDBOX, "the agent exhausted its process limit"),
    Kind("cpu_limit", POLICY, _SANDBOX, "the agent exhausted its CPU time"),
    Kind("disk_full", POLICY, _SANDBOX, "the agent filled its disk"),
    Kind("sandbox_error", POLICY, _SANDBOX, "the sandbox failed while the agent ran in it"),
    Kind("image_error", POLICY, _SANDBOX, "reported by a command the agent ran (an image that cannot be "
         "read before the agent runs is boot_failed)"),  # fmt: skip
    # -- the grader: the patch and the tests its code ran are the policy's
    Kind("patch_truncated", POLICY, _GRADER, "the runner cut the patch at its cap"),
    Kind("malformed_patch", POLICY, _GRADER, "the patch is not a patch"),
    Kind("flagged", POLICY, _GRADER, "the tests passed but a zeroing flag was raised"),
    Kind("tests_failed", POLICY, _GRADER, "required tests did not pass"),
    Kind("no_tests", POLICY, _GRADER, "no test ran"),
    Kind("report_mismatch", POLICY, _GRADER, "the log contradicts the grader's report"),
    Kind("tampered", POLICY, _GRADER, "the grader's evidence was tampered with"),
    Kind("sandbox_failed", POLICY, _GRADER, "the grading sandbox failed while the patch's code ran"),
    Kind("parser_failed", POLICY, _GRADER, "the row's parser could not read the log the patch's tests wrote"),
    Kind("bad_row", INFRASTRUCTURE, _GRADER, "the row's grading material is missing or malformed"),
    Kind("grading_setup_failed", INFRASTRUCTURE, _GRADER, "the grade's setup failed before the patch "
         "applied", True),  # fmt: skip
    Kind("grader_error", POLICY, _GRADER, "the grader itself raised while grading: it was reading the "
         "patch's tree and code, so a patch may have made it raise (a trained 0)"),  # fmt: skip
    # -- the gym runner
    Kind("bad_env_config", INFRASTRUCTURE, _GYM, "the row's env_config cannot make an environment"),
    Kind("adapter_error", INFRASTRUCTURE, _GYM, "the adapter refused or did not answer a session", True),
    Kind("model_error", INFRASTRUCTURE, _GYM, "the engine failed to answer", True),
    Kind("env_error", POLICY, _GYM, "the environment raised on the model's action"),
    Kind("cancelled", POLICY, _GYM, "the episode was cancelled"),
    Kind("length", POLICY, _GYM, "the episode overflowed its context"),
)
ROLLOUT_FAILED = "rollout_failed"  # the grader's verdict when the runner failed: the runner's kind decides


def failure_class(kind: str | None) -> FailureClass | None:
    """The class of failure ``kind``; None for no failure. An unknown kind is ``policy`` (fail closed)."""
    if not kind:
        return None
    known = KINDS.get(kind)
    return known.failure_class if known is not None else POLICY


def is_infrastructure(kind: str | None) -> bool:
    return failure_class(kind) == INFRASTRUCTURE


def rerun_helps(kind: str | None) -> bool:
    """Whether a new attempt may end differently: infrastructure that is not the row's own fault."""
    known = KINDS.get(kind or "")
    return known is not None and known.failure_class == INFRASTRUCTURE and known.rerun_helps


def reward_cause(failure_kind: str | None, rollout_failure: str | None) -> str | None:
    """The kind that decides a reward's class: the runner's (``details.rollout_failure``) for a rollout
    the runner failed before grading, else the grader's own verdict. A ``rollout_failed`` with no runner's
    kind (a writer before it was recorded) names itself, so it is policy."""
    if failure_kind == ROLLOUT_FAILED and rollout_failure:
        return rollout_failure
    return failure_kind
