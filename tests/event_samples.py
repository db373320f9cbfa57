"""One realistic, valid record per event type (without ``schema_version``: the codec fills it in)."""

from __future__ import annotations

import json

AT = 1_700_000_000_000  # a fixed instant, milliseconds since the epoch


def turn(**overrides) -> dict:
    """Turn 1 of the main chain, extending turn 0's prompt + output by a tool result."""
    record = {
        "rollout_id": "r-1", "chain_id": "main", "chain_kind": "main", "turn_index": 1,
        "prompt_ref_turn": 0, "prompt_ids": [151644, 872, 198], "prompt_tokens": 40,
        "output_ids": [9707, 0, 151645], "output_logprobs": [-0.25, -1.5, 0.0], "finish_reason": "stop",
        "policy_version": 3, "request_id": "req-7",
        "timings": {"started_at": AT, "finished_at": AT + 250, "generation_ms": 240}, "attempt_id": "a-1",
        "routed_experts": None, "output_top_logprobs": None,
    }
    return {**record, **overrides}


def segment(tokens: int = 6) -> dict:
    """A segment shaped like a real one: mostly sampled tokens, every fifth block of 500 a tool result."""
    response = [(i * 7919) % 151_000 for i in range(tokens)]
    mask = bytes(0 if (i // 500) % 5 == 4 else 1 for i in range(tokens))
    return {
        "segment_id": "r-1/0", "rollout_id": "r-1", "group_id": "g-1", "index": 0, "num_segments": 2,
        "kind": "wipe", "prompt_ids": list(range(min(tokens, 2_000))), "response_ids": response,
        "loss_mask": mask, "rollout_logprobs": [-(i % 97) / 8 for i in range(tokens)], "reward": 0.5,
        "trajectory_reward": 1.0, "policy_versions": [7 if m else -1 for m in mask], "created_at": AT,
        "attempt_id": "a-1", "chain_id": "main", "infos": json.dumps([{"turn": 0}, {"turn": 1, "ok": True}]),
        "routed_experts": None, "failure_class": None, "failure_cause": None, "rerun_rollout_id": None,
        "top_logprobs": None,
    }


SAMPLES: dict[str, dict] = {
    "task": {
        "rollout_id": "r-1", "group_id": "g-1", "sample_index": 0, "group_size": 4,
        "prompt": "Fix the failing test in tests/test_parse.py", "label": None,
        "metadata": json.dumps({"image": "python:3.11", "workdir": "/repo", "eval_cmd": "pytest -x"}),
        "submitted_at": AT, "env_config": None, "ctx_config": None, "messages": None, "attempt": 0,
        "refill_of": None, "refill_reason": None,
    },
    "turn": turn(),
    "session": {
        "rollout_id": "r-1", "chain_id": "sub-1", "kind": "frozen", "chain_kind": "subagent",
        "reason": "subagent", "turn_count": 5, "parent_chain_id": "main", "at": AT,
        "attempt_id": "a-1", "agent_id": "a1b2c3", "parent_tool_use_id": "toolu_1",
    },
    "diff": {
        "rollout_id": "r-1", "patch": b"--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+caf\xe9\n",
        "exit_status": 0,
        "wall_time_s": 81.25, "turns": 12, "error": None, "at": AT,
        "attempt_id": "a-1", "group_id": "g-1", "group_size": 4, "failure_kind": None,
        "patch_truncated": False,
        "task_metadata": json.dumps({"image": "python:3.11", "workdir": "/repo"}), "label": None,
        "image_digest": "sha256:abababababababababababababababababababababababababababababababab",
        "rerun_rollout_id": None,
    },
    "reward": {
        "rollout_id": "r-1", "reward": 1.0, "solved": True, "applied_cleanly": True,
        "details": json.dumps({"passed": 3, "failed": 0}), "failure_kind": None, "at": AT,
        "attempt_id": "a-1", "group_id": "g-1", "group_size": 4, "flags": [],
        "tests": [{"name": "tests/test_x.py::test_a", "status": "PASSED"}], "step_rewards": [], "infos": "[]",
        "image_digest": "sha256:abababababababababababababababababababababababababababababababab",
        "failure_class": None, "failure_cause": None, "rerun_rollout_id": None,
    },
    "segment": segment(),
    "policy": {"version": 8, "location": "/ckpt/policy-8", "published_at": AT},
    "dead_letter": {
        "source_topic": "turns", "partition": 2, "offset": 12345, "key": b"r-1", "value": b"RB\x01\x00",
        "error": "CodecError: turn v1 body is undecodable", "service": "segmenter", "at": AT,
    },
    "train_step": {
        "step": 8, "version": 8, "group_ids": ["g-1"], "segment_ids": ["r-1/0", "r-1/1", "r-2/0"],
        "rollouts": 2, "tokens_trained": 900, "response_tokens": 1200, "masked_fraction": 0.75,
        "reward_mean": 0.5, "solve_rate": 0.5, "loss": -0.0125, "grad_norm": 0.75, "clip_fraction": 0.01,
        "entropy": 1.25, "approx_kl": 0.0005, "logprob_diff_mean": 0.03, "logprob_diff_max": 0.5,
        "ratio_outside_fraction": 0.002, "replayed_fraction": 0.0, "routing_agreement": None,
        "staleness_mean": 0.5, "staleness_min": 0, "staleness_max": 1, "wait_s": 2.5, "step_s": 4.0,
        "trained_at": AT,
    },
}
