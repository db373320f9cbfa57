"""The assistant's turn as the turn core returns it, in no wire protocol's words.

:func:`rollbus.services.adapter.turn.run_turn` yields an :class:`AssistantTurn`; each wire protocol
(:mod:`rollbus.services.adapter.wire`) renders it in its own shape: Anthropic content blocks, an OpenAI chat
completion, Responses output items. The parts keep the order the model wrote them (reasoning, text, tool
calls), which the protocols that number their parts (Responses' item ids) rely on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

#: why a turn stopped (also the ``stop_reason`` label of ``rollbus_adapter_turns_total``)
END_TURN, MAX_TOKENS, TOOL_USE, STOP_SEQUENCE = "end_turn", "max_tokens", "tool_use", "stop_sequence"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: its id (:func:`rollbus.services.adapter.provenance.tool_use_id`), the tool's
    name and its arguments as an object."""

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reasoning:
    text: str
    signature: str  # names the turn and proves we wrote it (provenance.thinking_signature)


@dataclass(frozen=True)
class Text:
    text: str


Part = Reasoning | Text | ToolCall


@dataclass(frozen=True)
class AssistantTurn:
    """One turn: before generation (:class:`~rollbus.services.adapter.turn.Started`) only its id, model and
    prompt size are known; when done (``Done``) its parts, stop reason and output size."""

    id: str  # unique per turn, without a protocol's prefix (``msg_``, ``chatcmpl-``, ``resp_``)
    model: str
    reasoning: Reasoning | None = None
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    stop_reason: str | None = None  # END_TURN, MAX_TOKENS, TOOL_USE, STOP_SEQUENCE; None until done
    stop_sequence: str | None = None  # the stop string matched, when stop_reason is STOP_SEQUENCE
    input_tokens: int = 0
    output_tokens: int = 0

    def parts(self) -> Iterator[Part]:
        """Reasoning, text, then the tool calls: the parts present, in the order the model wrote them."""
        if self.reasoning is not None:
            yield self.reasoning
        if self.text:
            yield Text(self.text)
        yield from self.tool_calls

    def chat_message(self) -> dict[str, Any]:
        """The turn as the chat-template message committed to its chain's history (and so what a request
        echoing it must translate back to, whatever its protocol)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning.text
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": dict(call.arguments)},
                }
                for call in self.tool_calls
            ]
        return message


def stop_reason(finish_type: str, has_tool_calls: bool, matched: Any) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` from the engine's finish reason and the parsed turn."""
    if finish_type == "length":
        return MAX_TOKENS, None
    if has_tool_calls:
        return TOOL_USE, None
    if isinstance(matched, str):
        return STOP_SEQUENCE, matched
    return END_TURN, None
