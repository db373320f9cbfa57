"""What a history is: the plan it hands out for one request, and the Protocol both kinds implement
(:class:`~rollbus.services.adapter.canonical.canonical_history.CanonicalHistory`,
:class:`~rollbus.services.adapter.canonical.rerender_history.RerenderHistory`), so a caller never asks which
it has."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rollbus.services.adapter.canonical.echo import AssistantMessage, Message
from rollbus.trajectory import FrozenChain, SegmentKind, Turn


class StalePlan(ValueError):
    """A plan committed after the history moved on (another commit, or a different history)."""


@dataclass
class PromptPlan:
    """What to send for one request, and how it relates to the chain; commit it after sampling.

    ``reason`` says why a new chain starts (:mod:`rollbus.services.adapter.canonical` lists them); None
    when it continues.
    """

    prompt_ids: list[int]
    new_chain: bool
    reason: str | None
    reused_tokens: int
    rendered_tokens: int
    chain_id: str
    turn_index: int
    messages: list[Message] = field(repr=False)
    tools: list[dict] | None = field(repr=False)
    _epoch: tuple[int, int] = field(repr=False, default=(0, 0))
    _new_messages: list[Message] = field(repr=False, default_factory=list)
    _echoes: dict[int, Message] = field(repr=False, default_factory=dict)
    _adopt: list[Message] | None = field(repr=False, default=None)  # a resumed chain's context, once known


class History(Protocol):
    """One agent thread's chains, planned and committed one request at a time."""

    history_mode: str
    chain_name: str
    turns: list[Turn]
    sent: list[AssistantMessage]  # the assistant message returned for each of ``turns``
    frozen: list[FrozenChain]

    @property
    def chain_id(self) -> str:
        """The live chain's id (``<chain_name>`` or ``<chain_name>.<n>``)."""
        ...

    def continues(self, messages: Sequence[Message], tools: list[dict] | None) -> bool:
        """Whether the request extends the live chain (routes requests without an agent header)."""
        ...

    def plan(self, messages: Sequence[Message], tools: list[dict] | None) -> PromptPlan:
        """What to send for this request; nothing changes until :meth:`commit`."""
        ...

    def commit(
        self,
        plan: PromptPlan,
        output_ids: Sequence[int],
        output_logprobs: Sequence[float],
        finish_reason: str,
        policy_version: int,
        assistant_message: Message,
    ) -> Turn:
        """Record what was sampled for ``plan`` (StalePlan if the history moved on since)."""
        ...

    def resume(
        self, turns: Sequence[Turn], chain_number: int, is_ours: Callable[[Message], bool] | None
    ) -> None:
        """Continue a live chain known only from the bus (an adapter restart)."""
        ...

    def freeze(self, kind: SegmentKind) -> FrozenChain | None:
        """End the live chain (a finished sub-agent); the next plan starts a new chain."""
        ...

    def all_chains(self, final_kind: SegmentKind = "final") -> list[FrozenChain]:
        """The frozen chains, then the live one as ``final_kind``."""
        ...
