"""Rendering: full and suffix renders of one tokenizer's chat template, checked so a suffix appended to a
chain's tokens equals what rendering the whole conversation would give there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollbus.services.adapter.canonical.history import Message
from rollbus.services.adapter.markup import Markup, Shielded

# Stands in for the last assistant turn when rendering new messages: never appears in real text.
WINDOW_MARKER = "\u2063rollbus-window-\u2063"
_WINDOW_HEAD: list[Message] = [{"role": "user", "content": "."}]


class WindowCheckFailed(ValueError):
    """The chat template did not render new messages independently of what precedes them."""


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
        self.markup = Markup.of(tokenizer)  # content encodes as text; only the template's markup is special
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
        """The rendering with content shielded (:mod:`rollbus.services.adapter.markup`), checked against the
        neutral one."""
        shielded = self.markup.shield(messages, tools)
        text = self._render(shielded.messages, shielded.tools, True)
        if shielded.risky:
            neutral = self._render(shielded.neutral_messages, shielded.neutral_tools, True)
            self.markup.check(shielded, text, neutral)
        return text, shielded

    def full(self, messages: Sequence[Message], tools: list[dict] | None) -> list[int]:
        """The prompt's ids; :class:`rollbus.services.adapter.markup.ContentFormsMarkup` if content would form
        markup."""
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


def default_stop_ids(tokenizer: Any, renderer: TemplateRenderer) -> set[int]:
    """The template's end-of-turn token and the tokenizer's EOS: where a sampled output may stop."""
    eos = tokenizer.eos_token_id
    return {renderer.close_ids[0]} | ({eos} if isinstance(eos, int) else set())
