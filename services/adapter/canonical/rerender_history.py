"""The re-rendered history (``--history-mode rerender``): a full render every turn, the baseline the
canonical history is measured against."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rollbus.services.adapter.canonical.echo import AssistantMessage, normalise_assistant, tool_defaults
from rollbus.services.adapter.canonical.history import Message, PromptPlan, StalePlan
from rollbus.services.adapter.canonical.render import TemplateRenderer, default_stop_ids
from rollbus.trajectory import FrozenChain, SegmentKind, Turn


class RerenderHistory:
    """``--history-mode rerender``: a full render every turn, stitched later by ``merge_turns``.

    Same interface as :class:`CanonicalHistory`; restarts within a chain are found by
    ``merge_turns_all``, so ``frozen`` holds only chains ended by :meth:`freeze` (a finished sub-agent),
    and the next request after one starts chain ``<name>.1``. A request continues the chain when its
    messages are the last prompt's, then the assistant message we sent, then new user/tool messages.
    """

    history_mode = "rerender"

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop_token_ids: Sequence[int] | None = None,
        chain_name: str = "main",
        chat_template_kwargs: dict[str, Any] | None = None,
        keep_frozen: bool = True,
    ):
        self.keep_frozen = keep_frozen
        self.renderer = TemplateRenderer(tokenizer, chat_template_kwargs)
        self.stop_token_ids = set(stop_token_ids or default_stop_ids(tokenizer, self.renderer))
        self.chain_name = chain_name
        self.turns: list[Turn] = []
        self.sent: list[AssistantMessage] = []
        self.frozen: list[FrozenChain] = []
        self._chain_number = 0
        self._commits = 0
        self._last: tuple[list[Message], list[dict] | None] | None = None  # the last plan's request

    @property
    def chain_id(self) -> str:
        return self.chain_name if self._chain_number == 0 else f"{self.chain_name}.{self._chain_number}"

    def continues(self, messages: Sequence[Message], tools: list[dict] | None) -> bool:
        if not self.turns or self._last is None:
            return False
        last, last_tools = self._last
        n = len(last)
        return (
            tools == last_tools
            and len(messages) > n + 1
            and list(messages[:n]) == last
            and messages[n].get("role") == "assistant"
            and self.sent[-1].echoed_by(normalise_assistant(messages[n]), tool_defaults(tools))
            and all(m.get("role") in ("user", "tool") for m in messages[n + 1 :])
        )

    def plan(self, messages: Sequence[Message], tools: list[dict] | None) -> PromptPlan:
        ids = self.renderer.full(list(messages), tools)
        first = not self.turns
        epoch = (id(self), self._commits)
        return PromptPlan(
            ids,
            first,
            "first" if first else None,
            0,
            len(ids),
            self.chain_id,
            len(self.turns),
            list(messages),
            tools,
            epoch,
        )

    def commit(
        self,
        plan: PromptPlan,
        output_ids: Sequence[int],
        output_logprobs: Sequence[float],
        finish_reason: str,
        policy_version: int,
        assistant_message: Message,
    ) -> Turn:
        if plan._epoch != (id(self), self._commits):
            raise StalePlan(f"plan for turn {plan.turn_index} of {plan.chain_id} is stale; plan again")
        turn = Turn(
            plan.prompt_ids,
            list(output_ids),
            list(output_logprobs),
            finish_reason,
            policy_version,
            chain_id=self.chain_id,
            turn_index=len(self.turns),
        )
        self.turns.append(turn)
        self.sent.append(normalise_assistant(assistant_message))
        self._last = (list(plan.messages), plan.tools)
        self._commits += 1
        return turn

    def resume(
        self, turns: Sequence[Turn], chain_number: int, is_ours: Callable[[Message], bool] | None = None
    ) -> None:
        """Continue a live chain known only from the bus: every turn is a full render anyway."""
        # a resumed chain's earlier replies are unknown (None): only its turns came back from the bus
        self.turns, self.sent = list(turns), [None] * len(turns)  # type: ignore[list-item]
        self._chain_number, self._last, self._commits = chain_number, None, self._commits + 1

    def freeze(self, kind: SegmentKind) -> FrozenChain | None:
        """End the live chain, as :meth:`CanonicalHistory.freeze`; the next plan starts a new one."""
        if not self.turns:
            return None
        chain = FrozenChain(kind, self.turns, "rerender", self.chain_id)
        if self.keep_frozen:
            self.frozen.append(chain)
        self.turns, self.sent, self._last = [], [], None
        self._chain_number += 1
        self._commits += 1
        return chain

    def all_chains(self, final_kind: SegmentKind = "final") -> list[FrozenChain]:
        live = [FrozenChain(final_kind, self.turns, "rerender", self.chain_id)] if self.turns else []
        return self.frozen + live
