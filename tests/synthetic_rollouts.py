"""Synthetic rollouts written the way the adapter, runner and grader write them (for tests and bench/).

:class:`RolloutWriter` plays one attempt: turns with the prompt-reference encoding, ``opened``/``frozen``/
``closed`` session events in the adapter's order, a diff and a reward. It also keeps the oracle: the
frozen chains (full turns) in freeze order, which ``fan_out`` turns into the segments to expect.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from rollbus.trajectory import FrozenChain, Turn
from rollbus.turn_log import prompt_reference

Event = tuple[str, dict[str, Any]]  # (base topic name, record)


@dataclass
class _Live:
    kind: str
    turns: list[Turn] = field(default_factory=list)


@dataclass
class RolloutWriter:
    rollout_id: str
    attempt_id: str = "a1"
    group_id: str = "g1"
    policy_version: int = 3
    events: list[Event] = field(default_factory=list)
    frozen: list[FrozenChain] = field(default_factory=list)
    live: dict[str, _Live] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(50_000))
    _at: itertools.count = field(default_factory=lambda: itertools.count(1_700_000_000_000, 7))

    def sampled(self, n: int) -> list[int]:
        return [next(self._ids) for _ in range(n)]

    def turn(self, chain: str, kind: str, new_ids: list[int], output: int, *, fresh: bool = False) -> Turn:
        """One model call on ``chain``: its prompt is the chain's stream plus ``new_ids`` (or ``new_ids``
        alone when ``fresh``); ``output`` sampled tokens."""
        live = self.live.get(chain)
        if live is None:
            live = self.live[chain] = _Live(kind)
            self.session(chain, kind, "opened", 0)
        previous = live.turns[-1] if live.turns else None
        stream = [] if previous is None or fresh else [*previous.prompt_ids, *previous.output_ids]
        out = self.sampled(output)
        logprobs = [-(i % 97) / 100 for i in out]
        turn = Turn([*stream, *new_ids], out, logprobs, "stop", self.policy_version, chain, len(live.turns))
        ref, ids = prompt_reference(turn.prompt_ids, previous)
        live.turns.append(turn)
        self.events.append(("turns", {
            "rollout_id": self.rollout_id, "chain_id": chain, "chain_kind": kind,
            "turn_index": turn.turn_index,
            "prompt_ref_turn": ref, "prompt_ids": ids, "prompt_tokens": len(turn.prompt_ids),
            "output_ids": out, "output_logprobs": logprobs, "finish_reason": "stop",
            "policy_version": self.policy_version,
            "request_id": f"{self.attempt_id}-{chain}-{turn.turn_index}",
            "timings": {"started_at": 1, "finished_at": 2, "generation_ms": 1}, "attempt_id": self.attempt_id,
        }))  # fmt: skip
        if kind == "side":
            self.session(chain, kind, "frozen", 1, reason="side")
            del self.live[chain]
        return turn

    def session(self, chain: str, chain_kind: str, kind: str, count: int, reason: str | None = None) -> None:
        self.events.append(("sessions", {
            "rollout_id": self.rollout_id, "chain_id": chain, "kind": kind, "chain_kind": chain_kind,
            "reason": reason, "turn_count": count, "parent_chain_id": None, "at": next(self._at),
            "attempt_id": self.attempt_id,
        }))  # fmt: skip

    def freeze(self, chain: str, reason: str) -> None:
        live = self.live.pop(chain)
        self.session(chain, live.kind, "frozen", len(live.turns), reason=reason)
        kind = "subagent" if live.kind == "subagent" else "wipe"
        if live.kind in ("main", "subagent"):
            self.frozen.append(FrozenChain(kind, live.turns, chain_id=chain))

    def close(self) -> None:
        """The rollout ends: every live chain with turns gets ``closed`` (main first, as the adapter does)."""
        for chain, live in sorted(self.live.items(), key=lambda kv: kv[1].kind != "main"):
            self.session(chain, live.kind, "closed", len(live.turns), reason="rollout_end")

    def expected_chains(self) -> list[FrozenChain]:
        """The oracle: frozen chains in freeze order, live sub-agents, the live main chain as ``final``."""
        subs = [
            FrozenChain("subagent", x.turns, chain_id=c) for c, x in self.live.items() if x.kind == "subagent"
        ]
        mains = [FrozenChain("final", x.turns, chain_id=c) for c, x in self.live.items() if x.kind == "main"]
        return self.frozen + subs + mains

    def diff(self) -> None:
        self.events.append(("diffs", {
            "rollout_id": self.rollout_id, "patch": b"--- a\n+++ b\n", "exit_status": 0, "wall_time_s": 1.5,
            "turns": 3, "error": None, "at": next(self._at), "attempt_id": self.attempt_id,
            "group_id": self.group_id, "group_size": 4,
        }))  # fmt: skip

    def reward(self, value: float, details: str = "{}") -> dict[str, Any]:
        record = {
            "rollout_id": self.rollout_id, "reward": value, "solved": value > 0, "applied_cleanly": True,
            "details": details, "failure_kind": None, "at": next(self._at), "attempt_id": self.attempt_id,
            "group_id": self.group_id, "group_size": 4,
        }  # fmt: skip
        self.events.append(("rewards", record))
        return record


def simple_rollout(
    rollout_id: str,
    *,
    turns: int = 3,
    reward: float = 1.0,
    attempt: str = "a1",
    group: str = "g1",
    policy_version: int = 3,
) -> RolloutWriter:
    """A main agent with one sub-agent and one compaction, a side call; closed, diffed and rewarded."""
    w = RolloutWriter(rollout_id, attempt_id=attempt, group_id=group, policy_version=policy_version)
    w.turn("main", "main", [1, 2, 3, 4], 5)
    w.turn("title-0", "side", [9, 9], 3)
    w.turn("agent-x", "subagent", [7, 7, 7], 4)
    w.turn("agent-x", "subagent", [8], 2)
    w.freeze("agent-x", "subagent")
    for _ in range(turns - 1):
        w.turn("main", "main", [11, 12], 6)
    w.freeze("main", "compaction")
    w.turn("main.1", "main", [1, 2, 5], 4, fresh=True)
    w.turn("main.1", "main", [13], 3)
    w.close()
    w.diff()
    w.reward(reward)
    return w
