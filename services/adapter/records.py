"""The ``turn`` and ``session`` events the adapter publishes (schemas/turn.avsc, schemas/session.avsc)."""

from __future__ import annotations

import time
from typing import Any

from rollbus.events import RoutedExperts, SessionEvent, SessionKind, TurnEvent, TurnTimings
from rollbus.services.adapter.sessions import Agent
from rollbus.turn_log import prompt_reference


def turn_record(
    agent: Agent, turn: Any, previous: Any | None, request_id: str, timings: TurnTimings,
    routes: RoutedExperts | None = None, top_logprobs: bytes | None = None,
) -> TurnEvent:
    ref, prompt_ids = prompt_reference(turn.prompt_ids, previous)
    return TurnEvent(
        rollout_id=agent.rollout_id, chain_id=turn.chain_id, chain_kind=agent.kind,
        turn_index=turn.turn_index, prompt_ref_turn=ref, prompt_ids=prompt_ids,
        prompt_tokens=len(turn.prompt_ids), output_ids=list(turn.output_ids),
        output_logprobs=[float(x) for x in turn.output_logprobs], finish_reason=turn.finish_reason,
        policy_version=int(turn.policy_version), request_id=request_id, timings=timings,
        attempt_id=agent.attempt_id, routed_experts=routes, output_top_logprobs=top_logprobs,
    )  # fmt: skip


def session_record(
    agent: Agent, chain_id: str, kind: SessionKind, *, turn_count: int, reason: str | None = None
) -> SessionEvent:
    return SessionEvent(
        rollout_id=agent.rollout_id, chain_id=chain_id, kind=kind, chain_kind=agent.kind, reason=reason,
        turn_count=turn_count, parent_chain_id=agent.parent.chain_id if agent.parent is not None else None,
        at=now_ms(), attempt_id=agent.attempt_id, agent_id=agent.agent_id,
        parent_tool_use_id=agent.parent_tool_use_id,
    )  # fmt: skip


def now_ms() -> int:
    return int(time.time() * 1000)
