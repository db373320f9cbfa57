"""Message content is text: only the chat template's own markup becomes added-token ids.

A chat template pastes content (tool results, user text, tool inputs, the system prompt, tool schemas)
into its markup, and the tokenizer then finds every added token in the whole text: a tool result that
says ``<|im_end|>\\n<|im_start|>user`` would forge turn structure in the prompt. So a conversation is
rendered twice (:class:`Markup`):

* *shielded*: every added-token string inside content is replaced by one private-use character that
  occurs in no content of the request (so it cannot be confused with content, and a template that
  slices or trims strings cannot split it). Added tokens found in this rendering are the template's;
  each run of text between them, placeholders put back, is encoded with the tokenizer's model alone
  (no added tokens), exactly as the tokenizer encodes text between added tokens;
* *neutral*: every content string that could complete an added token together with the text around it
  (``think`` inside the template's ``'<' ~ key ~ '>'``, a tool name ending in ``<think`` before a
  template ``>``) is replaced by private-use characters. The template's markup must be the same token
  sequence in both renderings; otherwise content forms markup and the request is refused
  (:class:`ContentFormsMarkup`).

For content with no such strings the ids equal the tokenizer's plain encoding of the plain rendering.

A long run of text between added tokens is encoded once and kept (:data:`KEPT_TEXT_CHARS`): the system
prompt and the tools of a coding agent's conversation are one run of ~90k characters (~50 ms to encode) that
every new chain of a rollout and every rollout of the task renders again. The run's ids depend only on its
text (runs are encoded apart, between added tokens), so a kept run is the same ids as a fresh encoding.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

Message = dict[str, Any]
#: a run of text this long is kept once encoded (shorter ones cost less to encode than to look up and keep)
KEPT_TEXT_CHARS = 4096
KEPT_TEXTS = 16  # per tokenizer: ~80 KB of ids each for a 20k-token run
_PLACEHOLDERS = range(0x10FFFD, 0x100000, -1)  # Supplementary Private Use Area-B, for placeholders
_NEUTRAL_BASE = 0xF0000  # Supplementary Private Use Area-A, for neutral stand-ins
_NEUTRAL_DIGITS = 0xFFFE


class ContentFormsMarkup(ValueError):
    """Content and the template's text around it together spell an added token."""


@dataclass(frozen=True)
class Shielded:
    """A conversation ready to render twice (see the module docstring), and how to read it back."""

    messages: list[Message]
    tools: list[dict] | None
    neutral_messages: list[Message]
    neutral_tools: list[dict] | None
    restore: dict[int, str]  # placeholder code point -> the added-token string it stands for (translate)
    risky: bool  # some content could complete an added token with the text around it


def map_content(messages: Sequence[Message], tools: Sequence[dict] | None, f: Callable[[str], str]):
    """``messages`` and ``tools`` with ``f`` applied to every content string (and every key that is
    content: tool-call argument names, tool schema keys); roles and the other fields the template reads
    as structure are kept."""
    return [_message(m, f) for m in messages], None if tools is None else [_tool(t, f) for t in tools]


def _message(message: Message, f: Callable[[str], str]) -> Message:
    out = dict(message)
    for key in ("content", "reasoning_content", "tool_call_id", "name"):
        if key in out:
            out[key] = _content(out[key], f)
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_call(c, f) for c in out["tool_calls"]]
    return out


def _content(value: Any, f: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return f(value)
    if isinstance(value, list):  # text parts
        return [{**p, "text": f(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
                for p in value]  # fmt: skip
    return value


def _call(call: Any, f: Callable[[str], str]) -> Any:
    if not isinstance(call, dict):
        return call
    out = dict(call)
    if isinstance(out.get("id"), str):
        out["id"] = f(out["id"])
    fn = out.get("function")
    if isinstance(fn, dict):
        fn = dict(fn)
        if isinstance(fn.get("name"), str):
            fn["name"] = f(fn["name"])
        if "arguments" in fn:
            fn["arguments"] = _json(fn["arguments"], f)
        out["function"] = fn
    return out


def _tool(tool: Any, f: Callable[[str], str]) -> Any:
    if not isinstance(tool, dict):
        return tool
    out = dict(tool)
    fn = out.get("function") if isinstance(out.get("function"), dict) else None
    target = dict(fn) if fn is not None else out
    for key in ("name", "description"):
        if isinstance(target.get(key), str):
            target[key] = f(target[key])
    if "parameters" in target:
        target["parameters"] = _json(target["parameters"], f)
    if fn is not None:
        out["function"] = target
    return out


def _json(value: Any, f: Callable[[str], str]) -> Any:
    """Every string of a JSON value, keys included."""
    if isinstance(value, str):
        return f(value)
    if isinstance(value, dict):
        return {f(k) if isinstance(k, str) else k: _json(v, f) for k, v in value.items()}
    if isinstance(value, list):
        return [_json(v, f) for v in value]
    return value


def _strings(messages: Sequence[Message], tools: Sequence[dict] | None) -> list[str]:
    seen: list[str] = []

    def keep(text: str) -> str:
        seen.append(text)
        return text

    map_content(messages, tools, keep)
    return seen


_BUILT: weakref.WeakKeyDictionary[Any, Markup] = weakref.WeakKeyDictionary()  # see Markup.of


class Markup:
    """The added tokens of one tokenizer, and how to encode a rendered conversation with them."""

    def __init__(self, tokenizer: Any) -> None:
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
        self.ids = added
        self.added_ids = frozenset(added.values())
        longest_first = sorted(added, key=lambda t: (-len(t), t))
        # what the tokenizer does: the leftmost added token, the longest at that position
        self._find = re.compile("|".join(re.escape(t) for t in longest_first))
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        spec["added_tokens"] = []
        self.text_model = Tokenizer.from_str(json.dumps(spec))  # the same model, no added tokens
        self._inner = {t[i:j] for t in added for i in range(len(t)) for j in range(i + 1, len(t) + 1)}
        self._heads = {t[:k] for t in added for k in range(1, len(t))}  # proper prefixes
        self._tails = {t[k:] for t in added for k in range(1, len(t))}  # proper suffixes
        self._longest = max(map(len, added), default=0)
        self._kept = functools.lru_cache(maxsize=KEPT_TEXTS)(self._encode_text)  # thread-safe

    @classmethod
    def of(cls, tokenizer: Any) -> Markup:
        """The tokenizer's :class:`Markup`, built once per tokenizer while its added tokens stay the same:
        building one copies the tokenizer's whole model (seconds for a 248k vocabulary), and every chain's
        history renders through one."""
        added = {t.content: i for i, t in tokenizer.added_tokens_decoder.items()}
        try:
            cached = _BUILT.get(tokenizer)
        except TypeError:  # a tokenizer that cannot be weakly referenced is not cached
            return cls(tokenizer)
        if cached is None or cached.ids != added:
            cached = _BUILT[tokenizer] = cls(tokenizer)
        return cached

    def could_complete(self, text: str) -> bool:
        """Whether ``text`` could be part of an added token whose other part is text around it."""
        if not text:
            return False
        if text in self._inner:
            return True
        reach = min(len(text), self._longest)
        return any(text[-k:] in self._heads or text[:k] in self._tails for k in range(1, reach + 1))

    def shield(self, messages: Sequence[Message], tools: Sequence[dict] | None) -> Shielded:
        used = {c for s in _strings(messages, tools) for c in s}
        free = (chr(c) for c in _PLACEHOLDERS if chr(c) not in used)
        placeholder = {token: next(free) for token in self.ids}
        restore: dict[int, str] = {}

        def put(match: re.Match[str]) -> str:
            stand_in = placeholder[match.group()]
            restore[ord(stand_in)] = match.group()
            return stand_in

        def hide(text: str) -> str:
            return self._find.sub(put, text)

        shown_messages, shown_tools = map_content(messages, tools, hide)
        stand_ins: dict[str, str] = {}
        risky = False

        def neutral(text: str) -> str:
            nonlocal risky
            if not self.could_complete(text):
                return text
            risky = True
            return stand_ins.setdefault(text, _neutral(len(stand_ins)))

        neutral_messages, neutral_tools = map_content(shown_messages, shown_tools, neutral)
        return Shielded(shown_messages, shown_tools, neutral_messages, neutral_tools, restore, risky)

    def markup(self, rendered: str) -> list[str]:
        return self._find.findall(rendered)

    def check(self, shielded: Shielded, rendered: str, neutral: str) -> None:
        """Raise :class:`ContentFormsMarkup` unless both renderings carry the same markup."""
        if not shielded.risky:
            return
        got, expected = self.markup(rendered), self.markup(neutral)
        if got != expected:
            extra = next((a for a, b in zip(got, expected, strict=False) if a != b), None) or (
                got[len(expected)] if len(got) > len(expected) else expected[len(got)]
            )
            raise ContentFormsMarkup(
                f"message content and the chat template's text around it form {extra!r}: refused"
            )

    def encode(self, rendered: str, restore: dict[int, str]) -> list[int]:
        """Ids of a shielded rendering: its added tokens as themselves, everything else as text."""
        ids: list[int] = []
        at = 0
        for match in self._find.finditer(rendered):
            ids.extend(self._text(rendered[at : match.start()], restore))
            ids.append(self.ids[match.group()])
            at = match.end()
        ids.extend(self._text(rendered[at:], restore))
        return ids

    def _text(self, piece: str, restore: dict[int, str]) -> Sequence[int]:
        if not piece:
            return []
        if restore:
            piece = piece.translate(restore)
        return self._kept(piece) if len(piece) >= KEPT_TEXT_CHARS else self._encode_text(piece)

    def _encode_text(self, piece: str) -> Sequence[int]:
        """``piece``'s ids as text (kept only if it encodes without an added token: a refusal is not kept)."""
        ids = self.text_model.encode(piece, add_special_tokens=False).ids
        if not self.added_ids.isdisjoint(ids):  # the model itself spells one: never from content
            raise ContentFormsMarkup(f"the tokenizer's model encodes text as an added token: {piece[:60]!r}")
        return array("i", ids) if len(piece) >= KEPT_TEXT_CHARS else ids


def _neutral(index: int) -> str:
    digits = []
    while True:
        index, digit = divmod(index, _NEUTRAL_DIGITS)
        digits.append(chr(_NEUTRAL_BASE + digit))
        if not index:
            return "".join(digits)
