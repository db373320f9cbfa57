"""The failure taxonomy (``rollbus.failures``): every way a rollout can end has one class, and what it does
not know is the policy's (fail closed)."""

from __future__ import annotations

import typing

import pytest

from rollbus import failures
from rollbus.failures import INFRASTRUCTURE, POLICY, failure_class, rerun_helps, reward_cause
from rollbus.grading import verdict
from rollbus.sandbox import base as sandbox_base
from rollbus.services.gym_runner import gym
from rollbus.services.gym_runner import runner as gym_runner
from rollbus.services.sandbox_runner import outcome


def runner_kinds() -> set[str]:
    return {v for k, v in vars(outcome).items() if k.isupper() and isinstance(v, str)}


def grader_kinds() -> set[str]:
    names = ("PATCH_TOO_LARGE", "PATCH_TRUNCATED", "MALFORMED_PATCH", "PATCH_FAILED", "FLAGGED",
             "TESTS_FAILED", "NO_TESTS", "REPORT_MISMATCH", "TAMPERED", "TIMEOUT", "SANDBOX_FAILED",
             "BAD_ROW",
             "GRADING_SETUP_FAILED", "PARSER_FAILED")  # fmt: skip
    return {getattr(verdict, name) for name in names}


def sandbox_kinds() -> set[str]:
    return set(typing.get_args(sandbox_base.FailureKind)) - set(outcome.NOT_FAILURES)


def gym_kinds() -> set[str]:
    stops = set(typing.get_args(gym.StopReason)) - set(gym.CLEAN_STOPS)
    return stops | {gym.BAD_ENV_CONFIG, *gym_runner.RETRIED, "runner_error"}


def every_kind_in_the_code() -> set[str]:
    return runner_kinds() | grader_kinds() | sandbox_kinds() | gym_kinds() | {"grader_error", "length"}


def test_every_kind_the_code_can_name_is_classified_explicitly() -> None:
    """A kind added to a runner, the sandbox, the grader or the gym without a line in the taxonomy fails here
    (it would be policy by default, which is safe, but it must be decided, not inherited)."""
    unclassified = every_kind_in_the_code() - set(failures.KINDS)
    assert not unclassified, f"kinds with no class in rollbus.failures.KINDS: {sorted(unclassified)}"


EXPECTED = {
    # before the agent ran, or where it has no reach
    "bad_task": INFRASTRUCTURE, "boot_failed": INFRASTRUCTURE, "install_failed": INFRASTRUCTURE,
    "session_failed": INFRASTRUCTURE, "runner_error": INFRASTRUCTURE, "bad_row": INFRASTRUCTURE,
    "grading_setup_failed": INFRASTRUCTURE, "grader_error": POLICY, "bad_env_config": INFRASTRUCTURE,
    "adapter_error": INFRASTRUCTURE, "model_error": INFRASTRUCTURE,
    # the agent's own doing, or within its reach
    "timeout": POLICY, "agent_crashed": POLICY, "max_turns": POLICY, "patch_too_large": POLICY,
    "patch_failed": POLICY, "sandbox_broken": POLICY, "memory_limit": POLICY, "pids_limit": POLICY,
    "cpu_limit": POLICY, "disk_full": POLICY, "sandbox_error": POLICY, "image_error": POLICY,
    "patch_truncated": POLICY, "malformed_patch": POLICY, "flagged": POLICY, "tests_failed": POLICY,
    "no_tests": POLICY, "report_mismatch": POLICY, "tampered": POLICY, "sandbox_failed": POLICY,
    "parser_failed": POLICY, "env_error": POLICY, "cancelled": POLICY, "length": POLICY,
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_kind_has_its_class(kind: str) -> None:
    assert failure_class(kind) == EXPECTED[kind]


def test_the_expected_table_covers_the_whole_taxonomy() -> None:
    assert set(EXPECTED) == set(failures.KINDS)


@pytest.mark.parametrize("kind", ["", None])
def test_no_failure_has_no_class(kind: str | None) -> None:
    assert failure_class(kind) is None and not failures.is_infrastructure(kind)


@pytest.mark.parametrize(
    "kind", ["boot_failed ", "BOOT_FAILED", "infrastructure", "sandbox_exploded", "rollout_failed", "oom"]
)
def test_an_unknown_kind_is_the_policys(kind: str) -> None:
    """Fail closed: a policy that produces a failure nobody named must not escape its zero."""
    assert failure_class(kind) == POLICY and not rerun_helps(kind)


def test_only_infrastructure_a_new_attempt_can_mend_is_rerun() -> None:
    rerun = {name for name in failures.KINDS if rerun_helps(name)}
    assert rerun <= {n for n, k in failures.KINDS.items() if k.failure_class == INFRASTRUCTURE}
    assert {"boot_failed", "session_failed", "runner_error", "model_error"} <= rerun
    assert not rerun & {"bad_task", "bad_row", "bad_env_config"}  # the row's fault: a re-run fails the same


@pytest.mark.parametrize(
    ("failure_kind", "rollout_failure", "cause"),
    [
        ("rollout_failed", "boot_failed", "boot_failed"),  # the runner's kind decides a rollout it failed
        ("rollout_failed", "timeout", "timeout"),
        ("rollout_failed", None, "rollout_failed"),  # no runner's kind: itself, so policy
        ("tests_failed", None, "tests_failed"),
        ("tests_failed", "boot_failed", "tests_failed"),  # graded: the grader's verdict decides
        (None, None, None),
    ],
)
def test_a_rewards_cause(failure_kind: str | None, rollout_failure: str | None, cause: str | None) -> None:
    assert reward_cause(failure_kind, rollout_failure) == cause
