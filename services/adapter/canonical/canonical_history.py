"""The canonical history: each prompt is the chain's exact token stream plus the rendering of the new
messages only (see :mod:`rollbus.services.adapter.canonical` for why, and for the reasons a new chain
starts)."""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollbus.services.adapter.canonical.echo import (
    AssistantMessage,
    ToolDefaults,
    normalise_assistant,
    tool_defaults,
)
from rollbus.services.adapter.canonical.history import Message, PromptPlan, StalePlan
from rollbus.services.adapter.canonical.render import TemplateRenderer, WindowCheckFailed, default_stop_ids
from rollbus.trajectory import FrozenChain, SegmentKind, Turn

# ---------------------------------------------------------------- compact token storage


class TokenSlice(Sequence[int]):
    """``buffer[start:stop]`` without a copy: a turn's prompt and output as references into its chain.

    A canonical chain is one append-only token stream (each prompt extends the previous prompt, output
    and closing tokens), so the chain holds its tokens once, at 4 bytes each, and every turn is two
    slices of it. Reads (indexing, slicing, iteration, ``==`` with a list) behave like a list; slicing
    returns a list.
    """

    __slots__ = ("buffer", "start", "stop")

    def __init__(self, buffer: array, start: int, stop: int) -> None:
        self.buffer, self.start, self.stop = buffer, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self.buffer[self.start : self.stop][index].tolist()
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self.buffer[self.start + index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.buffer[self.start : self.stop])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenSlice | list | tuple | array):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __add__(self, other: Sequence[int]) -> list[int]:
        return [*self, *other]

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"TokenSlice({len(self)} tokens)"


@dataclass
class _Match:
    """How a request lines up with the chain: where new messages start, or why it cannot."""

    new_from: int = 0
    reason: str | None = None
    echoes: dict[int, Message] = field(default_factory=dict)


class CanonicalHistory:
    """One agent thread's chains: the live one (``turns``) and those frozen by rewrites (``frozen``).

    ``sent[i]`` is the normalised assistant message returned for ``turns[i]``. The stream and the
    messages already in the chain are private; plans are computed against them without mutation.
    Messages must be HF/OpenAI chat dicts with tool-call ``arguments`` as objects.
    """

    history_mode = "canonical"

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop_token_ids: Sequence[int] | None = None,
        chain_name: str = "main",
        chat_template_kwargs: dict[str, Any] | None = None,
        keep_frozen: bool = True,
    ):
        """``keep_frozen=False``: chains a rewrite ended are not kept (an adapter has them on the bus)."""
        self.keep_frozen = keep_frozen
        self.renderer = TemplateRenderer(tokenizer, chat_template_kwargs)
        stops = default_stop_ids(tokenizer, self.renderer) if stop_token_ids is None else stop_token_ids
        self.stop_token_ids = set(stops)
        self.chain_name = chain_name
        self.turns: list[Turn] = []
        self.sent: list[AssistantMessage] = []
        self.frozen: list[FrozenChain] = []
        self._chain_number = 0  # of the live chain, or of the next one when none is live
        self._commits = 0
        self._stream: array = array("i")  # the live chain's tokens, once; its turns slice it
        self._context: list[Message | int] = []  # the chain's messages; an int is the index of our turn
        self._echoes: dict[int, Message] = {}  # last raw echo of each of our turns (fast equality path)
        self._tools: list[dict] | None = None
        self._defaults: ToolDefaults = {}  # schema defaults of self._tools, for matching echoes
        self._opening = 0  # index of the chain's first non-system message
        self._ours: Callable[[Message], bool] | None = (
            None  # resumed from the bus: recognises our last turn's echo (messages unknown)
        )

    @property
    def chain_id(self) -> str:
        return self._chain_id(self._chain_number)

    def _chain_id(self, number: int) -> str:
        return self.chain_name if number == 0 else f"{self.chain_name}.{number}"

    @property
    def stream(self) -> list[int]:
        """The live chain's exact tokens: last prompt + last output + closing template tokens."""
        return self._stream.tolist()

    def continues(self, messages: Sequence[Message], tools: list[dict] | None) -> bool:
        """Whether this request extends the live chain: lets an adapter route sub-agent requests."""
        return bool(self.turns) and self._match(messages, tools).reason is None

    def resume(
        self, turns: Sequence[Turn], chain_number: int, is_ours: Callable[[Message], bool] | None
    ) -> None:
        """Continue a live chain known only from the bus (an adapter restart): its turns, not its messages.

        The next request is taken to continue it if its last assistant message is the echo of the
        chain's last turn (``is_ours(message)``: its tool_use ids or thinking signature name that turn)
        and only user/tool messages follow; the messages before it become the chain's context, as sent.
        """
        last = turns[-1]
        # a resumed chain's earlier replies are unknown (None): only its turns came back from the bus
        self.turns, self.sent, self._chain_number = list(turns), [None] * len(turns), chain_number  # type: ignore[list-item]
        self._stream = array("i", [*last.prompt_ids, *last.output_ids])
        self._stream.extend(self.renderer.closing_ids(last.output_ids, self.stop_token_ids))
        self._context, self._echoes, self._ours, self._commits = [], {}, is_ours, self._commits + 1

    def _match_resumed(self, messages: list[Message], tools: list[dict] | None) -> _Match:
        at = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if at is None or self._ours is None or not self._ours(messages[at]):
            return _Match(reason="unmatched_assistant")
        if at + 1 == len(messages):
            return _Match(reason="no_new_messages")
        return _Match(new_from=at + 1)

    def plan(self, messages: Sequence[Message], tools: list[dict] | None) -> PromptPlan:
        messages = list(messages)
        if self._ours is not None and self.turns:
            return self._plan_resumed(messages, tools)
        match = self._match(messages, tools) if self.turns else _Match(reason="first")
        epoch = (id(self), self._commits)
        if match.reason is None:
            try:
                return self._extension(messages, tools, match, epoch, adopt=None)
            except WindowCheckFailed:
                match = _Match(reason="window_check_failed")
        ids = self.renderer.full(messages, tools)
        chain_id = self._chain_id(self._chain_number + (1 if self.turns else 0))
        return PromptPlan(ids, True, match.reason, 0, len(ids), chain_id, 0, messages, tools, epoch)

    def _extension(
        self,
        messages: list[Message],
        tools: list[dict] | None,
        match: _Match,
        epoch: tuple[int, int],
        adopt: list[Message] | None,
    ) -> PromptPlan:
        """The plan that continues this chain: its stream plus the rendering of the new messages only
        (WindowCheckFailed when the renderer cannot append them: the caller starts a new chain). A resumed
        chain adopts the echoed history as its context instead of matching echoes."""
        new = messages[match.new_from :]
        suffix = self.renderer.suffix(new, tools)
        echoes = match.echoes if adopt is None else {}
        return PromptPlan(
            self._stream.tolist() + suffix, False, None, len(self._stream), len(suffix), self.chain_id,
            len(self.turns), messages, tools, epoch, new, echoes, adopt,
        )  # fmt: skip

    def _plan_resumed(self, messages: list[Message], tools: list[dict] | None) -> PromptPlan:
        """The first plan of a resumed chain: a suffix after our echoed turn, or a new chain."""
        match = self._match_resumed(messages, tools)
        epoch = (id(self), self._commits)
        if match.reason is None:
            try:
                return self._extension(messages, tools, match, epoch, adopt=messages[: match.new_from])
            except WindowCheckFailed:
                match = _Match(reason="window_check_failed")
        ids = self.renderer.full(messages, tools)
        chain_id = self._chain_id(self._chain_number + 1)
        return PromptPlan(ids, True, match.reason, 0, len(ids), chain_id, 0, messages, tools, epoch)

    def _match(self, messages: Sequence[Message], tools: list[dict] | None) -> _Match:
        if self._ours is not None:
            return self._match_resumed(list(messages), tools)
        if tools != self._tools:
            return _Match(reason="tools_changed")
        echoes: dict[int, Message] = {}
        for i, entry in enumerate(self._context):
            if i >= len(messages):
                return _Match(reason="removed_messages")
            message = messages[i]
            if isinstance(entry, int):
                if message == self._echoes.get(entry):
                    continue
                if message.get("role") != "assistant" or not self.sent[entry].echoed_by(
                    normalise_assistant(message), self._defaults
                ):
                    return _Match(reason=self._diverged(messages, i, "unmatched_assistant"))
                echoes[entry] = message
            elif message != entry:
                return _Match(reason=self._diverged(messages, i, "edited_history"))
        new_from = len(self._context)
        if new_from == len(messages):
            return _Match(reason="no_new_messages")
        if any(m.get("role") == "assistant" for m in messages[new_from:]):
            return _Match(reason="unsampled_assistant")
        return _Match(new_from=new_from, echoes=echoes)

    def _diverged(self, messages: Sequence[Message], at: int, otherwise: str) -> str:
        """Why a request that leaves the chain at message ``at`` starts a new one.

        A rewritten opening is a compaction; the chain's context up to ``at`` followed by only new
        user/tool messages is a fork (Claude Code's summary request branches off an earlier turn).
        """
        if at <= self._opening:
            return "compaction"
        if all(m.get("role") in ("user", "tool") for m in messages[at:]):
            return "fork"
        return otherwise

    def commit(
        self,
        plan: PromptPlan,
        output_ids: Sequence[int],
        output_logprobs: Sequence[float],
        finish_reason: str,
        policy_version: int,
        assistant_message: Message,
    ) -> Turn:
        """Record what was sampled for ``plan``; ``assistant_message`` is what the client was sent.

        The returned turn shares ``plan.prompt_ids`` (no copy of the context): don't mutate it.
        """
        if plan._epoch != (id(self), self._commits):
            raise StalePlan(f"plan for turn {plan.turn_index} of {plan.chain_id} is stale; plan again")
        if plan.new_chain:
            self._restart(plan)
        elif plan._adopt is not None:  # a resumed chain learns its context from the request continuing it
            self._context = [dict(m) for m in (*plan._adopt, *plan._new_messages)]
            self._tools = json.loads(json.dumps(plan.tools)) if plan.tools is not None else None
            self._defaults = tool_defaults(self._tools)
            self._opening = next((i for i, m in enumerate(plan._adopt) if m.get("role") != "system"), 0)
            self._ours = None
        else:
            self._context.extend(dict(m) for m in plan._new_messages)
            self._echoes.update((turn, dict(message)) for turn, message in plan._echoes.items())
        if plan.new_chain or plan._adopt is not None:  # a chain's own buffer; frozen turns keep theirs
            self._stream = array("i")
        stream = self._stream
        if plan.new_chain or plan._adopt is not None:
            stream.extend(plan.prompt_ids)
        else:
            stream.extend(plan.prompt_ids[len(stream) :])
        start = len(stream)
        stream.extend(output_ids)
        turn = Turn(  # views into the chain's stream where Turn declares lists: read, never appended to
            TokenSlice(stream, 0, start), TokenSlice(stream, start, len(stream)),  # type: ignore[arg-type]
            array("d", output_logprobs), finish_reason, policy_version,  # type: ignore[arg-type]
            chain_id=self.chain_id, turn_index=len(self.turns),
        )  # fmt: skip
        stream.extend(self.renderer.closing_ids(output_ids, self.stop_token_ids))
        self._context.append(len(self.turns))
        self.turns.append(turn)
        self.sent.append(normalise_assistant(assistant_message))
        self._commits += 1
        return turn

    def _restart(self, plan: PromptPlan) -> None:
        self._ours = None
        if self.turns:
            if self.keep_frozen:
                self.frozen.append(FrozenChain("wipe", self.turns, "canonical", self.chain_id))
            self._chain_number += 1
        self.turns, self.sent, self._echoes = [], [], {}
        self._context = [dict(m) for m in plan.messages]
        self._tools = json.loads(json.dumps(plan.tools)) if plan.tools is not None else None
        self._defaults = tool_defaults(self._tools)
        self._opening = next((i for i, m in enumerate(plan.messages) if m.get("role") != "system"), 0)

    def freeze(self, kind: SegmentKind) -> FrozenChain | None:
        """End the live chain (a finished sub-agent, or the trajectory's end); the next plan is ``first``."""
        if not self.turns:
            return None
        chain = FrozenChain(kind, self.turns, "canonical", self.chain_id)
        self.turns, self.sent, self._echoes, self._context, self._stream = [], [], {}, [], array("i")
        self._tools, self._ours = None, None
        self._chain_number += 1
        self._commits += 1
        return chain

    def all_chains(self, final_kind: SegmentKind = "final") -> list[FrozenChain]:
        """The frozen wipes, then the live chain as ``final_kind``: input for ``fan_out``."""
        live = [FrozenChain(final_kind, self.turns, "canonical", self.chain_id)] if self.turns else []
        return self.frozen + live
