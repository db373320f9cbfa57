"""Split a sampled assistant turn into reasoning, text and tool calls with SGLang's own parsers.

Using SGLang's ``ReasoningParser`` and ``FunctionCallParser`` (not a re-implementation) means the adapter
reads a completion exactly as an SGLang OpenAI server would. Around them this module only undoes the
fixed separators our chat template writes (``rollbus/templates/qwen3.6.jinja``), so that parsing a
rendered assistant turn gives back the message it was rendered from:

    prompt ... "<|im_start|>assistant\\n<think>\\n"   <- generation prompt (thinking_started=True)
    completion: REASONING "\\n</think>\\n\\n" TEXT ["\\n\\n"] "<tool_call>..." ["\\n<tool_call>..."]

With ``enable_thinking=False`` the prompt closes an empty block itself, so parse with
``thinking_started=False``: the completion is then plain text unless the model writes ``<think>`` itself.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

STOP_MARKERS = ("<|im_end|>", "<|endoftext|>")
_THINK_START = "<think>"
# Opening/closing pairs of qwen3_coder (and hermes-style) call markup; unbalanced = cut off mid-call.
_CALL_MARKUP = (
    ("<tool_call>", "</tool_call>"),
    ("<function=", "</function>"),
    ("<parameter=", "</parameter>"),
)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None  # None: the turn had no reasoning block at all
    text: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


@functools.cache
def _sglang():
    """Import lazily: SGLang's parser modules take seconds to import."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    return Tool, FunctionCallParser, ReasoningParser


def split_reasoning(
    text: str, *, parser: str = "qwen3", thinking_started: bool = True
) -> tuple[str | None, str]:
    """(reasoning, rest): ``thinking_started`` says the prompt already opened ``<think>\\n``."""
    if not thinking_started and _THINK_START not in text:
        return None, text
    _, _, ReasoningParser = _sglang()
    reasoning_parser = ReasoningParser(
        model_type=parser, stream_reasoning=False, force_reasoning=thinking_started
    )
    reasoning, rest = reasoning_parser.parse_non_stream(text)
    reasoning = reasoning or ""
    if text.startswith(_THINK_START):  # the model opened the block itself: "<think>\n" is ours to drop
        reasoning = reasoning.removeprefix("\n")
    return reasoning.removesuffix("\n"), (rest or "").removeprefix("\n\n")


def split_tool_calls(
    text: str, tools: list[dict], *, parser: str = "qwen3_coder"
) -> tuple[str, list[ParsedToolCall]]:
    """(text, calls); markup the parser cannot turn into calls stays in the text.

    Stricter than SGLang alone, which also accepts a call cut off mid-value (e.g. by max_tokens): running
    a truncated command is worse than not running it, so unbalanced call markup keeps everything as text.
    """
    if not calls_are_closed(text):
        return text, []
    Tool, FunctionCallParser, _ = _sglang()
    call_parser = FunctionCallParser(
        tools=[Tool.model_validate(tool) for tool in tools], tool_call_parser=parser
    )
    rest, items = call_parser.parse_non_stream(text)
    calls = [_tool_call(item.name, item.parameters) for item in items]
    parsed = [call for call in calls if call is not None]
    if not calls or len(parsed) < len(calls):
        return text, []
    return rest.removesuffix("\n\n"), parsed


def calls_are_closed(text: str) -> bool:
    return all(text.count(opening) == text.count(closing) for opening, closing in _CALL_MARKUP)


def _tool_call(name: str | None, parameters: str) -> ParsedToolCall | None:
    try:
        arguments = json.loads(parameters or "{}")
    except json.JSONDecodeError:
        return None
    if not name or not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name=name, arguments=arguments)


def parse_output(
    text: str,
    tools: list[dict],
    *,
    tool_parser: str = "qwen3_coder",
    reasoning_parser: str | None = "qwen3",
    thinking_started: bool = True,
) -> ParsedOutput:
    """Parse one completion (the text after the generation prompt). Never raises on odd model output."""
    for marker in STOP_MARKERS:
        if text.endswith(marker):
            text = text.removesuffix(marker)
            break
    reasoning, rest = (None, text)
    if reasoning_parser:
        reasoning, rest = split_reasoning(text, parser=reasoning_parser, thinking_started=thinking_started)
    content, calls = split_tool_calls(rest, tools, parser=tool_parser)
    return ParsedOutput(reasoning=reasoning, text=content, tool_calls=calls)
