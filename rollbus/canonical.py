"""Canonical append-only history: each prompt is the chain's exact token stream plus the new messages.

A coding agent sends its whole conversation every turn. Re-rendering and re-tokenizing it drifts
from what was sampled (templates drop reasoning, tool inputs come back re-serialised, BPE merges
differently across boundaries), and every drifted token is a sampled token we can no longer train.
Instead we keep the tokens the model actually saw and sampled, recognise the assistant messages the
client echoes back as our own outputs, and render only what is new (tool results, user text) plus
the generation prompt. Per-turn cost grows with the new tokens, not with the context.

Only a real history rewrite starts a new chain from a full render; the old chain is frozen as a
``wipe``. The plan's ``reason`` names the rewrite:

* ``first``: the thread's first request (or the first after :meth:`CanonicalHistory.freeze`);
* ``tools_changed``: the offered tools differ;
* ``compaction``: the conversation's opening (its first non-system message) was rewritten, e.g.
  Claude Code's "This session is being continued from a previous conversation...";
* ``fork``: the messages match a strict prefix of the chain's context (by the same rules as an
  extension: our assistant turns echoed) and then add only new user/tool messages; Claude Code's
  compaction request is one (the conversation up to an earlier point, then "write a summary");
* ``unmatched_assistant``: an echoed assistant message is not what we sampled;
* ``edited_history``: a later context message changed;
* ``removed_messages``: the request stops inside the chain's context, adding nothing;
* ``no_new_messages``: the request is exactly the chain's context;
* ``unsampled_assistant``: a new assistant message we never sampled (e.g. a prefill);
* ``window_check_failed``: the template did not render the new messages independently.

Usage (one :class:`CanonicalHistory` per agent thread: the main agent, each sub-agent)::

    plan = history.plan(messages, tools)          # no mutation; plan.prompt_ids goes to the engine
    turn = history.commit(plan, output_ids, output_logprobs, finish_reason, policy_version,
                          assistant_message)      # the message we parsed and sent back
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollbus.markup import Markup, Shielded
from rollbus.trajectory import FrozenChain, SegmentKind, Turn

Message = dict[str, Any]

# Stands in for the last assistant turn when rendering new messages: never appears in real text.
WINDOW_MARKER = "\u2063rollbus-window-\u2063"
_WINDOW_HEAD: list[Message] = [{"role": "user", "content": "."}]


class StalePlan(ValueError):
    """A plan committed after the history moved on (another commit, or a different history)."""


class WindowCheckFailed(ValueError):
    """The chat template did not render new messages independently of what precedes them."""


# ---------------------------------------------------------------- assistant messages


@dataclass(frozen=True)
class AssistantMessage:
    """An assistant message reduced to what survives a client round trip.

    Tool arguments are canonical JSON (sorted keys, no whitespace) because the Claude Code CLI
    re-serialises tool inputs; text and reasoning are stripped of surrounding whitespace.
    """

    text: str
    reasoning: str
    tool_calls: tuple[tuple[str, str, str], ...]  # (id, name, canonical JSON arguments)

    def echoed_by(self, echo: AssistantMessage, defaults: ToolDefaults | None = None) -> bool:
        """Whether ``echo`` is this message as sent back; the client may drop the reasoning.

        The Claude Code CLI validates tool inputs against their schemas and echoes them with schema
        defaults filled in (Edit comes back with ``"replace_all": false``): an echoed argument the model
        did not write is accepted when it equals that tool's schema default.
        """
        return (
            echo.text == self.text
            and echo.reasoning in ("", self.reasoning)
            and len(echo.tool_calls) == len(self.tool_calls)
            and all(
                _call_echoed(sent, back, defaults or {})
                for sent, back in zip(self.tool_calls, echo.tool_calls, strict=True)
            )
        )


ToolDefaults = dict[str, dict[str, Any]]  # tool name -> {argument: schema default}


def tool_defaults(tools: Sequence[dict] | None) -> ToolDefaults:
    """Each tool's JSON-schema ``default`` values, by tool and argument name."""
    found: ToolDefaults = {}
    for tool in tools or ():
        function = tool.get("function", tool)
        properties = (function.get("parameters") or {}).get("properties") or {}
        defaults = {k: v["default"] for k, v in properties.items() if isinstance(v, dict) and "default" in v}
        if defaults:
            found[function["name"]] = defaults
    return found


def _call_echoed(sent: tuple[str, str, str], back: tuple[str, str, str], defaults: ToolDefaults) -> bool:
    if sent == back:
        return True
    if sent[:2] != back[:2]:
        return False
    ours, theirs = json.loads(sent[2]), json.loads(back[2])
    if not isinstance(ours, dict) or not isinstance(theirs, dict):
        return False
    filled = defaults.get(sent[1], {})
    added = theirs.keys() - ours.keys()
    return (
        all(theirs[k] == ours[k] for k in ours.keys() & theirs.keys())
        and ours.keys() <= theirs.keys()
        and all(k in filled and theirs[k] == filled[k] for k in added)
    )


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def canonical_json(value: Any) -> str:
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else {}
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def normalise_assistant(message: Message) -> AssistantMessage:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call)
        calls.append((call.get("id", ""), function["name"], canonical_json(function.get("arguments", {}))))
    return AssistantMessage(
        text=_text(message.get("content")).strip(),
        reasoning=(message.get("reasoning_content") or "").strip(),
        tool_calls=tuple(calls),
    )


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


# ---------------------------------------------------------------- rendering


class TemplateRenderer:
    """Full renders and suffix renders of one tokenizer's chat template.

    A suffix is rendered in a small window, ``[user ".", assistant MARKER] + new``, and cut after the
    marker's closing tokens. Rendering "window without the new messages" and taking the difference
    would not do: Qwen-style templates change how the last assistant turn renders depending on what
    follows it. The cut is checked (marker once, closing text right after it, suffix starting at a
    special token so tokenizing it alone equals tokenizing it in context).
    """

    def __init__(self, tokenizer: Any, chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.special_ids = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        self.markup = Markup(tokenizer)  # content encodes as text; only the template's markup is special
        closed = self._render(_WINDOW_HEAD + [{"role": "assistant", "content": WINDOW_MARKER}], None, False)
        self.close_text = closed[closed.index(WINDOW_MARKER) + len(WINDOW_MARKER) :]
        self.close_ids = self.encode(self.close_text)
        self._suffix_needs_tools: bool | None = None

    def _render(self, messages: Sequence[Message], tools: list[dict] | None, generation: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=generation, tokenize=False, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _shielded(self, messages: Sequence[Message], tools: list[dict] | None) -> tuple[str, Shielded]:
        """The rendering with content shielded (:mod:`rollbus.markup`), checked against the neutral one."""
        shielded = self.markup.shield(messages, tools)
        text = self._render(shielded.messages, shielded.tools, True)
        if shielded.risky:
            neutral = self._render(shielded.neutral_messages, shielded.neutral_tools, True)
            self.markup.check(shielded, text, neutral)
        return text, shielded

    def full(self, messages: Sequence[Message], tools: list[dict] | None) -> list[int]:
        """The prompt's ids; :class:`rollbus.markup.ContentFormsMarkup` if content would form markup."""
        text, shielded = self._shielded(messages, tools)
        return self.markup.encode(text, shielded.restore)

    def suffix(self, new: Sequence[Message], tools: list[dict] | None) -> list[int]:
        """Tokens for ``new`` + generation prompt, as the template renders them after an assistant turn."""
        if self._suffix_needs_tools is None:
            self._suffix_needs_tools = self._suffix_text(new, tools)[0] != self._suffix_text(new, None)[0]
        text, restore = self._suffix_text(new, tools if self._suffix_needs_tools else None)
        ids = self.markup.encode(text, restore)
        if not ids or ids[0] not in self.special_ids:
            raise WindowCheckFailed(f"rendered suffix does not start at a special token: {text[:40]!r}")
        return ids

    def _suffix_text(self, new: Sequence[Message], tools: list[dict] | None) -> tuple[str, dict[int, str]]:
        window = _WINDOW_HEAD + [{"role": "assistant", "content": WINDOW_MARKER}] + list(new)
        text, shielded = self._shielded(window, tools)
        at = text.find(WINDOW_MARKER)
        if at < 0 or text.find(WINDOW_MARKER, at + 1) >= 0:
            raise WindowCheckFailed("the window's assistant marker is missing or repeated")
        after = at + len(WINDOW_MARKER)
        if not text.startswith(self.close_text, after):
            raise WindowCheckFailed("the assistant turn closes differently when messages follow it")
        return text[after + len(self.close_text) :], shielded.restore

    def closing_ids(self, output_ids: Sequence[int], stop_token_ids: set[int]) -> list[int]:
        """Template tokens that follow a sampled output in history (``\\n`` after ``<|im_end|>``).

        An output that ended on any stop token (``<|endoftext|>`` too) keeps it verbatim in place of
        the template's end-of-turn token; a truncated one gets the whole closing, end token included.
        """
        if output_ids and output_ids[-1] in stop_token_ids and self.close_ids[0] in stop_token_ids:
            return self.close_ids[1:]
        return list(self.close_ids)


# ---------------------------------------------------------------- the plan


@dataclass
class PromptPlan:
    """What to send for one request, and how it relates to the chain; commit it after sampling.

    ``reason`` says why a new chain starts (the module docstring lists them); None when it continues.
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


@dataclass
class _Match:
    """How a request lines up with the chain: where new messages start, or why it cannot."""

    new_from: int = 0
    reason: str | None = None
    echoes: dict[int, Message] = field(default_factory=dict)


# ---------------------------------------------------------------- histories


def _default_stop_ids(tokenizer: Any, renderer: TemplateRenderer) -> set[int]:
    eos = tokenizer.eos_token_id
    return {renderer.close_ids[0]} | ({eos} if isinstance(eos, int) else set())


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
        stops = _default_stop_ids(tokenizer, self.renderer) if stop_token_ids is None else stop_token_ids
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
        self._ours: Any = None  # resumed from the bus: recognises our last turn's echo (messages unknown)

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

    def resume(self, turns: Sequence[Turn], chain_number: int, is_ours: Any) -> None:
        """Continue a live chain known only from the bus (an adapter restart): its turns, not its messages.

        The next request is taken to continue it if its last assistant message is the echo of the
        chain's last turn (``is_ours(message)``: its tool_use ids or thinking signature name that turn)
        and only user/tool messages follow; the messages before it become the chain's context, as sent.
        """
        last = turns[-1]
        self.turns, self.sent, self._chain_number = list(turns), [None] * len(turns), chain_number  # type: ignore[list-item]
        self._stream = array("i", [*last.prompt_ids, *last.output_ids])
        self._stream.extend(self.renderer.closing_ids(last.output_ids, self.stop_token_ids))
        self._context, self._echoes, self._ours, self._commits = [], {}, is_ours, self._commits + 1

    def _match_resumed(self, messages: list[Message], tools: list[dict] | None) -> _Match:
        at = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if at is None or not self._ours(messages[at]):
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
            self._context = [dict(m) for m in plan._adopt] + [dict(m) for m in plan._new_messages]
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
        turn = Turn(
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
        self.stop_token_ids = set(stop_token_ids or _default_stop_ids(tokenizer, self.renderer))
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
            ids, first, "first" if first else None, 0, len(ids), self.chain_id, len(self.turns),
            list(messages), tools, epoch,
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
            plan.prompt_ids, list(output_ids), list(output_logprobs), finish_reason, policy_version,
            chain_id=self.chain_id, turn_index=len(self.turns),
        )
        self.turns.append(turn)
        self.sent.append(normalise_assistant(assistant_message))
        self._last = (list(plan.messages), plan.tools)
        self._commits += 1
        return turn

    def resume(self, turns: Sequence[Turn], chain_number: int, is_ours: Any = None) -> None:
        """Continue a live chain known only from the bus: every turn is a full render anyway."""
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
